// Replays files through the fuzz targets without libFuzzer: the main() of
// the corpus tests in builds whose compiler has no libFuzzer (g++). The
// program fuzz_replay (tests/fuzz/CMakeLists.txt) includes every target
// under its own entry name (fuzz_entries.cpp), then this file with
// CPDISPATCH_FUZZ_TARGETS, the list of their names.
//   fuzz_replay <target> <files or folders>...
// Each file (every regular file inside a folder, sorted) is run once through
// the target's entry. A finding aborts, as under libFuzzer.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>
#include <vector>

#ifndef CPDISPATCH_FUZZ_TARGETS
#error "compiled through fuzz_replay.cpp, which defines CPDISPATCH_FUZZ_TARGETS"
#endif

namespace {

using Entry = int (*)(const std::uint8_t*, std::size_t);

struct Target {
  std::string_view name;
  Entry entry;
};

#define CPDISPATCH_REPLAY_ENTRY(name) Target{#name, &cpdispatch_fuzz_##name},
constexpr Target targets[] = {CPDISPATCH_FUZZ_TARGETS(CPDISPATCH_REPLAY_ENTRY)};
#undef CPDISPATCH_REPLAY_ENTRY

std::vector<std::filesystem::path> inputs_of(const std::filesystem::path& arg) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(arg)) {
    for (const auto& entry : std::filesystem::directory_iterator(arg))
      if (entry.is_regular_file()) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(arg);
  }
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  const Target* target = nullptr;
  for (const Target& t : targets)
    if (argc > 1 && t.name == argv[1]) target = &t;
  if (target == nullptr) {
    std::fprintf(stderr, "usage: fuzz_replay <target> <files or folders>...; targets:");
    for (const Target& t : targets) std::fprintf(stderr, " %.*s", static_cast<int>(t.name.size()), t.name.data());
    std::fprintf(stderr, "\n");
    return 2;
  }
  std::size_t replayed = 0;
  for (int i = 2; i < argc; ++i) {
    if (!std::filesystem::exists(argv[i])) {
      std::fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 2;
    }
    for (const auto& file : inputs_of(argv[i])) {
      std::ifstream in(file, std::ios::binary);
      const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      target->entry(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  if (replayed == 0) {  // an empty corpus would prove nothing
    std::fprintf(stderr, "replay: no input for %s\n", argv[1]);
    return 2;
  }
  std::printf("replay: %zu inputs through %s, no finding\n", replayed, argv[1]);
  return 0;
}
