#pragma once
//! \file
//! The `dsv4` command line, as a library function: the app is a two-line main(), the tests
//! drive it exactly as a user does, and an embedding program can reuse it.

#include <ostream>
#include <string>
#include <vector>

#include "dsv4/dsv4.hpp"

namespace dsv4::cli {

inline void usage(std::ostream& os) {
  os << "usage: dsv4 <command> [options]\n\n"
        "commands:\n"
        "  info --config NAME   print the layer schedule and the cache bytes per token of a\n"
        "                       built-in model (";
  std::string names;
  for (const auto& n : models::builtin_names()) names += (names.empty() ? "" : ", ") + n;
  os << names << "; default v41-flash)\n"
        "  version              print the dsv4 version\n"
        "  help                 print this text\n";
}

//! Run the CLI; returns the process exit code (0 ok, 2 usage error). Never throws.
inline int run(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  try {
    if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      usage(args.empty() ? err : out);
      return args.empty() ? 2 : 0;
    }
    const std::string& cmd = args[0];
    if (cmd == "version" || cmd == "--version") {
      out << "dsv4 " << DSV4_VERSION_MAJOR << "." << DSV4_VERSION_MINOR << "." << DSV4_VERSION_PATCH << "\n";
      return 0;
    }
    if (cmd == "info") {
      std::string config = models::v41_flash::name;
      for (std::size_t i = 1; i < args.size(); ++i) {
        if (args[i] == "--config") {
          if (i + 1 >= args.size()) throw error("info: --config needs a value");
          config = args[++i];
        } else if (args[i].rfind("--config=", 0) == 0) {
          config = args[i].substr(9);
        } else {
          throw error("info: unknown option '" + args[i] + "'");
        }
      }
      models::print_info(out, models::describe_builtin(config));
      return 0;
    }
    throw error("unknown command '" + cmd + "' (try: dsv4 help)");
  } catch (const std::exception& e) {
    err << "dsv4: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace dsv4::cli
