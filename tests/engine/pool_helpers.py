"""Making a test's pass run on a pool thread for sure, whatever the timing."""

import threading


def on_a_pool_thread_too(work):
    """``work`` made to hold the calling thread before its second chunk until a pool thread has run one.

    However fast the calling thread is, some of the pass then runs on another
    thread (its first chunk or block is taken first, so the chunks or blocks
    that wait for it can become ready). Results are unchanged: only the timing is.
    """
    caller = threading.get_ident()
    other_ran = threading.Event()
    calls = [0]

    def wrapped(*args):
        if threading.get_ident() != caller:
            try:
                return work(*args)
            finally:
                other_ran.set()
        calls[0] += 1
        if calls[0] == 2:
            assert other_ran.wait(timeout=60), "no pool thread ran a chunk"
        return work(*args)

    return wrapped
