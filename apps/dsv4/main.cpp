//! \brief The dsv4 command-line tool.
//! Usage: dsv4 info --config v41-flash

#include <iostream>

#include "dsv4/cli.hpp"
#ifdef DSV4_CLI_CUDA
#include "cuda_backend.hpp"
#endif

int main(int argc, char** argv) {
  dsv4::cli::backends extra;
#ifdef DSV4_CLI_CUDA
  extra.cuda = dsv4::apps::cuda_generate;
  extra.cuda_engine = dsv4::apps::cuda_engine;
#endif
  return dsv4::cli::run(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr, extra);
}
