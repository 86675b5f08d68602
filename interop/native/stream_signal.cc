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
// The two handlers of the second section serve a step program queued ahead (see there).
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// A driver call's failure as the handler's error: "ckv <handler>: <call> failed with CUresult <rc>".
static ffi::Error DriverFailed(const char* handler, const char* call, int rc) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("ckv ") + handler + ": " + call + " failed with CUresult " + std::to_string(rc));
}

// One run of a handler in its `state` words: [0] the count of runs, [1] the stream of the last.
static ffi::Error Counted(uint64_t state, uint64_t stream) {
  auto* words = reinterpret_cast<uint64_t*>(state);
  // atomic: on a CPU the handlers of several devices of one program run on threads at once
  __atomic_store_n(&words[1], stream, __ATOMIC_RELAXED);
  __atomic_fetch_add(&words[0], 1, __ATOMIC_RELAXED);
  return ffi::Error::Success();
}

using EventRecord = int (*)(void* event, void* stream);                    // cuEventRecord
using StreamWaitEvent = int (*)(void* stream, void* event, unsigned flags);  // cuStreamWaitEvent

static ffi::Error SignalOnStream(void* stream, ffi::RemainingArgs, ffi::RemainingRets, uint64_t record_fn,
                                 uint64_t wait_fn, uint64_t ready_event, uint64_t then_wait, uint64_t state) {
  if (int rc = reinterpret_cast<EventRecord>(record_fn)(reinterpret_cast<void*>(ready_event), stream)) {
    return DriverFailed("stream signal", "cuEventRecord", rc);
  }
  if (then_wait != 0) {
    if (int rc = reinterpret_cast<StreamWaitEvent>(wait_fn)(stream, reinterpret_cast<void*>(then_wait), 0)) {
      return DriverFailed("stream signal", "cuStreamWaitEvent", rc);
    }
  }
  return Counted(state, reinterpret_cast<uint64_t>(stream));
}

static ffi::Error SignalOnHost(ffi::RemainingArgs, ffi::RemainingRets, uint64_t, uint64_t, uint64_t, uint64_t,
                               uint64_t state) {
  return Counted(state, 0);
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

// A step program's hooks (interop.stream_handoff.StepFlags), for a whole step queued ahead of
// the torch work it depends on.  XLA runs a program's first execution thunk by thunk, records the
// second into a command buffer (a CUDA graph) where its thunks are command-buffer compatible, and
// replays that graph from then on: what a handler enqueued while being recorded becomes a graph
// node with its values fixed, and a replay runs no host code.  So neither handler reads host
// state per step, and both declare themselves compatible.
//
// The signal records `ready_event`: while the stream is being captured, as an external event node
// (cuEventRecordWithFlags with CU_EVENT_RECORD_EXTERNAL, which the driver refuses outside a
// capture), else as a plain record.
//
// The flag wait holds the stream until the 32-bit word at device address `flag` is 1 (torch writes
// it once a step, cuStreamWriteValue32), a stream memory operation (cuStreamWaitValue32). It leaves
// the word at 1: torch zeroes every word before the next step's program, which waits for that on
// JAX's stream (StepRunner.begin), and a write back to 0 here added 1.5 us to every layer's
// hand-off (tools/flag_wait_latency.py: the wait resumes the stream 3.7-6.0 us after torch's
// compute ends on an H100, an event 1.5-2.1).  A one-thread kernel that polls the word resumed it in
// about 2 us, but it sits on an SM through all of torch's compute: with 4 ms of cuBLAS matmuls a
// layer the step took 28-35% longer (BENCHMARKS.md, fortieth section; presumably GEMMs sized to
// every SM losing the one it holds, not profiled).  Its operands pass through aliased; the last is
// the step's flag words themselves (the abandon word among them), so what the program reads of them
// it reads after the wait (a step released half-way sets the abandon word, and the program's later
// writes are masked by it), from a buffer the caller owns: none of the hooks' buffers lives in
// XLA's scratch memory, which programs run between steps move, and which would make XLA record the
// hooks anew.
//
// `state` counts the handlers' runs (an execution or a recording, never a replay), with the stream
// of the last: the program's, or kCapturing where XLA was recording it on a capture stream of its
// own.  The host handlers only count.
using EventRecordWithFlags = int (*)(void* event, void* stream, unsigned flags);  // cuEventRecordWithFlags
using StreamIsCapturing = int (*)(void* stream, int* status);                      // cuStreamIsCapturing
// cuStreamWaitValue32
using StreamWaitValue32 = int (*)(void* stream, uint64_t address, uint32_t value, unsigned flags);
constexpr unsigned kEventRecordExternal = 0x1;  // CU_EVENT_RECORD_EXTERNAL
constexpr unsigned kWaitValueEq = 0x1;          // CU_STREAM_WAIT_VALUE_EQ
constexpr uint64_t kCapturing = 1;              // the stream word of a run under a capture

// Whether `stream` is being captured into `*capturing` (CU_STREAM_CAPTURE_STATUS_NONE is 0).
static ffi::Error Capturing(uint64_t capturing_fn, void* stream, const char* handler, bool* capturing) {
  int status = 0;
  if (int rc = reinterpret_cast<StreamIsCapturing>(capturing_fn)(stream, &status)) {
    return DriverFailed(handler, "cuStreamIsCapturing", rc);
  }
  *capturing = status != 0;
  return ffi::Error::Success();
}

// The stream word of a step hook's run: its stream, or kCapturing.
static uint64_t StepStream(void* stream, bool capturing) {
  return capturing ? kCapturing : reinterpret_cast<uint64_t>(stream);
}

static ffi::Error StepSignalOnStream(void* stream, ffi::RemainingArgs, ffi::RemainingRets, uint64_t record_fn,
                                     uint64_t capturing_fn, uint64_t ready_event, uint64_t state) {
  bool capturing = false;
  if (ffi::Error error = Capturing(capturing_fn, stream, "stream signal", &capturing); error.failure()) {
    return error;
  }
  if (int rc = reinterpret_cast<EventRecordWithFlags>(record_fn)(reinterpret_cast<void*>(ready_event), stream,
                                                                 capturing ? kEventRecordExternal : 0)) {
    return DriverFailed("stream signal", "cuEventRecordWithFlags", rc);
  }
  return Counted(state, StepStream(stream, capturing));
}

static ffi::Error StepSignalOnHost(ffi::RemainingArgs, ffi::RemainingRets, uint64_t, uint64_t, uint64_t,
                                   uint64_t state) {
  return Counted(state, 0);
}

#define CKV_STEP_SIGNAL_ATTRS            \
  .Attr<uint64_t>("record_fn")           \
      .Attr<uint64_t>("capturing_fn")    \
      .Attr<uint64_t>("ready_event")     \
      .Attr<uint64_t>("state")

XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvStreamStepSignal, StepSignalOnStream,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().RemainingArgs().RemainingRets()
                                  CKV_STEP_SIGNAL_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvHostStepSignal, StepSignalOnHost,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets() CKV_STEP_SIGNAL_ATTRS);

static ffi::Error WaitFlagOnStream(void* stream, ffi::RemainingArgs, ffi::RemainingRets, uint64_t wait_fn,
                                   uint64_t capturing_fn, uint64_t flag, uint64_t state) {
  bool capturing = false;
  if (ffi::Error error = Capturing(capturing_fn, stream, "flag wait", &capturing); error.failure()) {
    return error;
  }
  if (int rc = reinterpret_cast<StreamWaitValue32>(wait_fn)(stream, flag, 1, kWaitValueEq)) {
    return DriverFailed("flag wait", "cuStreamWaitValue32", rc);
  }
  return Counted(state, StepStream(stream, capturing));
}

static ffi::Error WaitFlagOnHost(ffi::RemainingArgs, ffi::RemainingRets, uint64_t, uint64_t, uint64_t,
                                 uint64_t state) {
  return Counted(state, 0);
}

#define CKV_WAIT_ATTRS                   \
  .Attr<uint64_t>("wait_fn")             \
      .Attr<uint64_t>("capturing_fn")    \
      .Attr<uint64_t>("flag")            \
      .Attr<uint64_t>("state")

XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvStreamWaitFlag, WaitFlagOnStream,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().RemainingArgs().RemainingRets()
                                  CKV_WAIT_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CkvHostWaitFlag, WaitFlagOnHost,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets() CKV_WAIT_ATTRS);
