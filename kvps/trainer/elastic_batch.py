"""The Trainer in an elastic job: the combined batch of the members the caller counted,
restated as the batch of the job's fixed size that the servers scale rounds to."""


class ElasticBatch:
    """``step(batch_size)`` takes the combined batch, this worker's times ``kv.num_workers``,
    as in a fixed job. In an elastic dist_sync job the servers scale each round's sum by
    ``reference / (its members)`` (KVStore.scale_rounds), so the Trainer normalizes by the
    batch of ``reference`` workers: ``rescale_grad = 1 / (per-worker batch x reference)``,
    the same before and after a change, which is why a change needs no new optimizer on the
    servers (a collective that workers, learning of a change at different steps, could not
    meet)."""

    def __init__(self, kv, reference):
        self.kv, self.reference = kv, reference
        self.counted = kv.num_workers   # the members at the last step
        self.per_worker = None

    def job_batch(self, batch_size):
        """``batch_size`` (over the members the caller counted) as ``reference`` workers'.
        The caller read ``kv.num_workers`` just before this reads it; a change in between
        (its I/O thread learns of changes at any time) would misread the per-worker batch,
        so the count of the last step is tried too, and the one that keeps the per-worker
        batch of the last step wins."""
        now = self.kv.num_workers
        counts = (now, self.counted) if now != self.counted else (now,)
        count = next((c for c in counts if batch_size / c == self.per_worker), now)
        self.counted, self.per_worker = now, batch_size / count
        return batch_size * self.reference / count
