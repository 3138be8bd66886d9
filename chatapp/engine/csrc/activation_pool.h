#pragma once
// A step's big activations (a prompt's projections, norms and attention outputs) from a pool of blocks that earlier
// steps freed, instead of fresh memory.
//
// Why: glibc hands a block of more than its mmap threshold out as fresh pages and returns it to the kernel when it is
// freed, so the next layer's block of the same size faulted its pages in again (~1.5 us a page on this VM). Whether a
// size stays on glibc's heap instead depends on the order of earlier frees: 512-token prompts of a 1B Q8_0 model took
// 3 to 90 thousand page faults and ran at 511-598 tok/s, from one prompt to the next (573-603 with the pool, ~2.9
// thousand faults). A layer's sizes repeat in every layer, so after the first layer the pool serves them all.
#include <ATen/ATen.h>

// at::empty(sizes, options) for CPU tensors; of 1 MiB or more, from the pool (a block freed by a tensor it
// gave out returns to it; at most 256 MiB waits there, the rest goes back to the system).
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// Gives every block waiting in the pool back to the system (and glibc's free heap top to the kernel); returns the
// bytes the pool held. The engine calls it once it has been idle a while: a chat's last long prompt would
// otherwise keep up to 256 MiB resident while nothing runs, and the next prompt maps its pages in again (~20 ms
// for a 1B model's 512 tokens) before the pool serves it as before.
int64_t release_idle_activations();
