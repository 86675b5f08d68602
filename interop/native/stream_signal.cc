// The torch adapter's in-program stream signal as an XLA FFI handler.
//
// A layer program passes its workspace (and the buffers its prefetches write) through this
// custom call, aliased: a data dependency that places the call after the layer's own kernels
// and before every prefetch kernel.  XLA runs a custom call's handler on the host thread that
// enqueues the program, in thunk order, with the program's stream, so what the handler enqueues
// on that stream lands exactly between the two.  On a GPU it records `ready_event` there (torch's
// stream waits on it for the workspace) and, when `then_wait` is not 0, makes the stream wait on
// that event (torch's reads of the ring slots the prefetches overwrite).  The CUDA driver's
// cuEventRecord and cuStreamWaitEvent come in as addresses, so this file needs no CUDA headers.
//
// `state` is the address of two host uint64 words: calls so far and the last stream handle, which
// the caller checks after each dispatch (one call, on the stream it ordered against).  The host
// handler (CPU programs, which have no stream) only counts.
//
// The flag wait (CkvStreamWaitFlag) is the other direction, for a program queued ahead of the
// torch work it depends on: it makes the program's stream wait until the 32-bit word at device
// address `flag` reaches `*base + offset` (cuStreamWaitValue32, GEQ: a cyclic comparison, so the
// counter may wrap), then copies the 32-bit word at device address `abandon` into its first
// result, so the program reads it only after the wait (a step released half-way sets it, and the
// program's later writes are masked by it).  `*base` is read while XLA enqueues the program: one
// compiled program serves every step.  The host handler only counts and writes 0.
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using EventRecord = int (*)(void* event, void* stream);                    // cuEventRecord
using StreamWaitEvent = int (*)(void* stream, void* event, unsigned flags);  // cuStreamWaitEvent
using StreamWaitValue32 = int (*)(void* stream, uint64_t address, uint32_t value, unsigned flags);
using MemcpyDtoDAsync = int (*)(uint64_t dst, uint64_t src, size_t bytes, void* stream);
constexpr unsigned kWaitValueGeq = 0x0;  // CU_STREAM_WAIT_VALUE_GEQ

static ffi::Error SignalOnStream(void* stream, ffi::RemainingArgs, ffi::RemainingRets, uint64_t record_fn,
                                 uint64_t wait_fn, uint64_t ready_event, uint64_t then_wait, uint64_t state) {
  auto* words = reinterpret_cast<uint64_t*>(state);
  words[1] = reinterpret_cast<uint64_t>(stream);
  if (int rc = reinterpret_cast<EventRecord>(record_fn)(reinterpret_cast<void*>(ready_event), stream)) {
    return ffi::Error(ffi::ErrorCode::kInternal, "ckv stream signal: cuEventRecord failed with CUresult " +
                                                     std::to_string(rc));
  }
  if (then_wait != 0) {
    if (int rc = reinterpret_cast<StreamWaitEvent>(wait_fn)(stream, reinterpret_cast<void*>(then_wait), 0)) {
      return ffi::Error(ffi::ErrorCode::kInternal, "ckv stream signal: cuStreamWaitEvent failed with CUresult " +
                                                       std::to_string(rc));
    }
  }
  words[0] += 1;
  return ffi::Error::Success();
}

static ffi::Error SignalOnHost(ffi::RemainingArgs, ffi::RemainingRets, uint64_t, uint64_t, uint64_t, uint64_t,
                               uint64_t state) {
  auto* words = reinterpret_cast<uint64_t*>(state);
  words[1] = 0;
  words[0] += 1;
  return ffi::Error::Success();
}

#define CKV_SIGNAL_ATTRS                 \
  .Attr<uint64_t>("record_fn")           \
      .Attr<uint64_t>("wait_fn")         \
      .Attr<uint64_t>("ready_event")     \
      .Attr<uint64_t>("then_wait")       \
      .Attr<uint64_t>("state")

XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvStreamSignal, SignalOnStream,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().RemainingArgs().RemainingRets()
                                  CKV_SIGNAL_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvHostSignal, SignalOnHost,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets() CKV_SIGNAL_ATTRS);

static ffi::Error WaitFlagOnStream(void* stream, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> abandoned,
                                   ffi::RemainingRets, uint64_t wait_fn, uint64_t copy_fn, uint64_t flag,
                                   uint64_t base, uint64_t offset, uint64_t abandon, uint64_t state) {
  auto* words = reinterpret_cast<uint64_t*>(state);
  words[1] = reinterpret_cast<uint64_t>(stream);
  uint32_t value = *reinterpret_cast<const uint32_t*>(base) + static_cast<uint32_t>(offset);
  if (int rc = reinterpret_cast<StreamWaitValue32>(wait_fn)(stream, flag, value, kWaitValueGeq)) {
    return ffi::Error(ffi::ErrorCode::kInternal, "ckv flag wait: cuStreamWaitValue32 failed with CUresult " +
                                                     std::to_string(rc));
  }
  uint64_t out = reinterpret_cast<uint64_t>(abandoned->untyped_data());
  if (int rc = reinterpret_cast<MemcpyDtoDAsync>(copy_fn)(out, abandon, sizeof(uint32_t), stream)) {
    return ffi::Error(ffi::ErrorCode::kInternal, "ckv flag wait: cuMemcpyDtoDAsync failed with CUresult " +
                                                     std::to_string(rc));
  }
  words[0] += 1;
  return ffi::Error::Success();
}

static ffi::Error WaitFlagOnHost(ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> abandoned, ffi::RemainingRets,
                                 uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t state) {
  auto* words = reinterpret_cast<uint64_t*>(state);
  *reinterpret_cast<uint32_t*>(abandoned->untyped_data()) = 0;
  words[1] = 0;
  words[0] += 1;
  return ffi::Error::Success();
}

#define CKV_WAIT_ATTRS                   \
  .Attr<uint64_t>("wait_fn")             \
      .Attr<uint64_t>("copy_fn")         \
      .Attr<uint64_t>("flag")            \
      .Attr<uint64_t>("base")            \
      .Attr<uint64_t>("offset")          \
      .Attr<uint64_t>("abandon")         \
      .Attr<uint64_t>("state")

XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvStreamWaitFlag, WaitFlagOnStream,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .RemainingRets() CKV_WAIT_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvHostWaitFlag, WaitFlagOnHost,
                              ffi::Ffi::Bind().RemainingArgs().Ret<ffi::AnyBuffer>().RemainingRets() CKV_WAIT_ATTRS);
