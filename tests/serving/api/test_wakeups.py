"""serving.api.wakeups: wake-ups from another thread, coalesced per batch, none lost."""

import asyncio
import threading

from serving.api.wakeups import Wakeups


def test_one_batch_carries_every_wake_of_a_step():
  async def main():
    loop = asyncio.get_running_loop()
    w = Wakeups(loop)
    events = [asyncio.Event() for _ in range(10)]
    def step():  # the serving loop's thread: one step's outputs to ten streams
      for e in events:
        w.wake(e)
    t = threading.Thread(target=step)
    t.start()
    t.join()  # the asyncio loop has not run since: every wake joined the first batch
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 5)
    return w.batches
  assert asyncio.run(main()) == 1


def test_a_wake_after_the_batch_ran_is_not_lost():
  async def main():
    loop = asyncio.get_running_loop()
    w = Wakeups(loop)
    e = asyncio.Event()
    for i in range(3):
      e.clear()
      threading.Thread(target=w.wake, args=(e,)).start()
      await asyncio.wait_for(e.wait(), 5)
    return w.batches
  assert asyncio.run(main()) == 3


def test_many_threads_many_events():
  async def main():
    loop = asyncio.get_running_loop()
    w = Wakeups(loop)
    events = [asyncio.Event() for _ in range(64)]
    threads = [threading.Thread(target=lambda i=i: [w.wake(events[j]) for j in range(i, 64, 4)])
               for i in range(4)]
    for t in threads:
      t.start()
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 5)
    for t in threads:
      t.join()
    return w.batches
  assert 1 <= asyncio.run(main()) <= 64


def test_a_closed_loop_holds_nothing():
  loop = asyncio.new_event_loop()
  w = Wakeups(loop)
  loop.close()
  e = asyncio.Event()
  for _ in range(2):  # each wake tries again (the stream logs the failure), none is held
    try:
      w.wake(e)
      raise AssertionError("a closed loop must refuse the batch")
    except RuntimeError:
      pass
    assert w.held == 0
