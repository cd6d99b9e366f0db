// Where the tests find the repository's models and fixtures (one definition for every test file).
#pragma once

#include <filesystem>

namespace mtpx::test_paths {

inline const std::filesystem::path kSource = MTPX_SOURCE_DIR;
inline const std::filesystem::path kFixtures = kSource / "tests" / "fixtures";
inline const std::filesystem::path kDefaultModel = kSource / "models" / "default";

}  // namespace mtpx::test_paths
