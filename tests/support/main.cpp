// The Boost.Test framework, compiled once (header-only "included" variant: no Boost library to
// link, so the suite builds wherever the Boost headers are). Every test executable links this.
#define BOOST_TEST_MODULE dsv4
#include <boost/test/included/unit_test.hpp>
