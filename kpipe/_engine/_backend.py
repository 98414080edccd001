"""The backend protocol: what runs a loader's `target[key]` (or a map step's
`target(inputs)`), and what else each backend can do -- declared, never asked with
`isinstance`.

Every backend (`ProcessBackend` in `_pool.py`; `ThreadBackend` and `InlineBackend` in
`_local.py`; a remote one would join them) offers the common part:

    submit(key, inputs=None, seed=None) -> seq   queue target[key] (seed: reseed the
                                                 worker's random/numpy.random first)
    get(seq, on_starved=None) -> (tree, treedef, meta)   wait for it, in any order
    discard(seq)                                 its result is dropped when it comes
    reset_target(target, dumped=None)            the next tasks see this target
    close(force=False)                           idempotent; nothing outlives it
    closed, name, pids, num_workers

and declares its capabilities as class attributes. Where one is False, the methods that
belong to it keep this base class's answers, which make the loader's rules for it no-ops:

    keeps_copy      workers hold a pickled copy of the target, so a hook's changes must be
                    sent to them (`dump`, `current_state`, `same_state`, `fingerprint`);
                    False: they share this process's object, and what they loaded ahead
                    is stale after a hook.
    has_slots       batches live in shared-memory slots whose number the owner budgets
                    (`needs_new_slot`, `slots_held`, `slot_releases`, `is_first_use`,
                    `slot_setup_s`, `mean_batch_s`, `idle_workers`, `prepare_slots`).
    can_send_state  a new target version can be queued behind the tasks in flight without
                    a wait (`send_state`, `shared`): `epoch_end_ahead=True`.
    can_resize      workers can be added and retired while running (`add_worker`,
                    `retire_worker`; `timings` feeds the controller): `workers="auto"`.
    thread_budget   worker processes whose native thread pools are limited
                    (`worker_threads`, `thread_pools()`).

Used from one thread at a time (the owner's lock).
"""


class Backend:
    """Base of every backend: the capability flags (all off) and their no-op answers."""

    keeps_copy = False
    has_slots = False
    can_send_state = False
    can_resize = False
    thread_budget = False

    closed = False

    @property
    def pids(self):
        return []

    # -- slots (has_slots) --------------------------------------------------------------
    def needs_new_slot(self, for_idle_worker=True):
        return False

    def slots_held(self):
        return 0

    @property
    def slot_releases(self):
        return 0

    def is_first_use(self, seq):
        return False

    def slot_setup_s(self, nbytes=None):
        return 0.0

    def mean_batch_s(self):
        return 0.0

    def idle_workers(self):
        return 0

    def prepare_slots(self, up_to):
        return 0

    def batches_per_call(self):
        """Batches that travel to a worker together now (the window keeps twice that in
        flight per worker); 1 but for Ray actors (`_ray.py`)."""
        return 1

    # -- thread budget (thread_budget) ---------------------------------------------------
    @property
    def worker_threads(self):
        return None

    def thread_pools(self):
        return []
