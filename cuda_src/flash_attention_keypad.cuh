// FA_MASK_KEYPAD, the Hopper attention kernels' fourth mask kind (flash_attention_fwd_sm90.cu,
// flash_attention_bwd_sm90.cu): a bool mask the same for every query row (m_sq == 0, e.g. padded text tokens). The
// forward sorts the keys into granules of 64 (all kept / all masked / mixed) once per CTA, so only a tile that mixes
// kept and masked keys reads the mask element by element; the backward reads each thread's two keys once.
// NVRTC-compatible: no includes.
#pragma once

#define FA_MASK_KEYPAD 3
#define FA_KEYPAD_GRANULES 256  // keys <= 64 * 256 (longer sequences take FA_MASK_BOOL)
#define FA_KEYPAD_MASKED 0
#define FA_KEYPAD_KEPT 1
#define FA_KEYPAD_MIXED 2
