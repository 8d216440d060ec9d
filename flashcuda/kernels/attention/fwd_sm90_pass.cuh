// The pass-specific macros of one part of flash_fwd_sm90_fused.cu, included before each part
// (no #pragma once). The host (fwd_sm90.Sm90FwdFused.spec) passes every macro that may differ
// between the two passes with a prefix, FC_P1_X for the first pass and FC_P2_X for the second;
// FC_PASS picks the prefix, and an X the host left out takes flash_fwd_sm90.cu's default.
#undef FC_STAGES
#undef FC_Q_STAGES
#undef FC_O_TMA
#undef FC_SMEM_BYTES
#undef FC_MASKED_V
#undef FC_NAN_FLAGS
#undef FC_NAN_FIXUP
#undef FC_PRODUCER_REGS
#undef FC_CONSUMER_REGS
#undef FC_ROLE_ONLY
#if FC_PASS == 1
#define FC_STAGES FC_P1_STAGES
#define FC_SMEM_BYTES FC_P1_SMEM_BYTES
#define FC_PRODUCER_REGS FC_P1_PRODUCER_REGS
#define FC_CONSUMER_REGS FC_P1_CONSUMER_REGS
#ifdef FC_P1_Q_STAGES
#define FC_Q_STAGES FC_P1_Q_STAGES
#endif
#ifdef FC_P1_O_TMA
#define FC_O_TMA FC_P1_O_TMA
#endif
#ifdef FC_P1_MASKED_V
#define FC_MASKED_V FC_P1_MASKED_V
#endif
#ifdef FC_P1_NAN_FLAGS
#define FC_NAN_FLAGS FC_P1_NAN_FLAGS
#endif
#elif FC_PASS == 2
#define FC_STAGES FC_P2_STAGES
#define FC_SMEM_BYTES FC_P2_SMEM_BYTES
#define FC_PRODUCER_REGS FC_P2_PRODUCER_REGS
#define FC_CONSUMER_REGS FC_P2_CONSUMER_REGS
#ifdef FC_P2_Q_STAGES
#define FC_Q_STAGES FC_P2_Q_STAGES
#endif
#ifdef FC_P2_O_TMA
#define FC_O_TMA FC_P2_O_TMA
#endif
#ifdef FC_P2_MASKED_V
#define FC_MASKED_V FC_P2_MASKED_V
#endif
#ifdef FC_P2_NAN_FLAGS
#define FC_NAN_FLAGS FC_P2_NAN_FLAGS
#endif
#else
#error "FC_PASS: 1 or 2"
#endif
