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
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using EventRecord = int (*)(void* event, void* stream);                    // cuEventRecord
using StreamWaitEvent = int (*)(void* stream, void* event, unsigned flags);  // cuStreamWaitEvent

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
