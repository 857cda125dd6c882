//! \brief The dsv4 command-line tool.
//! Usage: dsv4 info --config v41-flash

#include <iostream>

#include "dsv4/cli.hpp"

int main(int argc, char** argv) {
  return dsv4::cli::run(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
