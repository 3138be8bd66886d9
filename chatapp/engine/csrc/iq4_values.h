#pragma once
// IQ4_NL's 16 values (ggml-common.h's kvalues_iq4nl), which IQ4_NL and IQ4_XS weights index with 4 bits:
// as they are (the AVX2 loops' sign trick reads them signed) and + 128 (the unsigned bytes VNNI dots read).
#include <cstdint>

alignas(16) inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) inline constexpr uint8_t kIQ4Codes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
