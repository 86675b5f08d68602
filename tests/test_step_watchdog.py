"""The step program's watchdog (`interop.step_runner`): a stalled step is reported once, a step
that keeps releasing layers or is finished never is.  (Its abandonment of a real step, with the
host blocked in a device synchronization, is tested on a GPU in test_interop_gpu.py.)"""
import threading
import time

from interop.step_runner import _Watchdog


def _watch(timeout_s):
    stalls = []
    fired = threading.Event()

    def on_stall():
        stalls.append(time.monotonic())
        fired.set()

    return _Watchdog(on_stall, timeout_s), stalls, fired


def test_a_step_without_releases_is_reported_once_after_the_timeout():
    dog, stalls, fired = _watch(0.2)
    start = time.monotonic()
    dog.arm()
    assert fired.wait(5)
    time.sleep(0.5)                                        # and not again: the deadline was spent
    dog.stop()
    assert len(stalls) == 1 and 0.2 <= stalls[0] - start < 2


def test_releases_within_the_timeout_and_a_finished_step_are_never_reported():
    dog, stalls, fired = _watch(0.3)
    dog.arm()
    for _ in range(8):                                     # 0.8 s of a step releasing every 0.1 s
        time.sleep(0.1)
        dog.arm()
    dog.disarm()                                           # the last layer released
    assert not fired.wait(0.6)
    dog.arm()                                              # the next step, which stalls
    assert fired.wait(5)
    dog.stop()
    assert len(stalls) == 1


def test_stop_ends_the_thread_and_a_later_arm_starts_another():
    dog, stalls, fired = _watch(0.2)
    dog.arm()
    first = dog._thread
    dog.stop()
    assert not first.is_alive() and not stalls
    dog.arm()
    assert dog._thread is not first and fired.wait(5)
    dog.stop()
