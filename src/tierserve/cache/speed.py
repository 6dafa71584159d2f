"""What the ``auto`` prefetch policy decides on: is reading a prefix from L3 faster than computing
it? Both speeds are measured as the node works (moving averages), so the answer follows the store,
the network and the model actually in use."""

from __future__ import annotations

import threading

SMOOTHING = 0.2  # weight of the newest sample in the moving averages
MIN_PREFILL_TOKENS = 16  # steps with fewer prompt tokens say little about prefill speed


class SpeedModel:
    """L3 read and write bandwidth (bytes/s, fed by the prefetch reader and the backup writer on
    the L3 lanes) and prefill speed (tokens/s, fed by the engine thread). Until a speed is measured
    it is taken as favourable to waiting: the first reads then measure L3."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read_bps = 0.0
        self.write_bps = 0.0
        self.prefill_tps = 0.0

    def record_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.read_bps = _average(self.read_bps, nbytes / seconds)

    def record_write(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.write_bps = _average(self.write_bps, nbytes / seconds)

    def write_seconds(self, nbytes: int) -> float | None:
        """How long writing ``nbytes`` to L3 takes, from this node's own backups (the other nodes
        write to the same store); None until measured."""
        with self._lock:
            return nbytes / self.write_bps if self.write_bps else None

    def compute_seconds(self, tokens: int) -> float | None:
        """How long computing ``tokens`` prompt tokens takes here; None until measured."""
        with self._lock:
            return tokens / self.prefill_tps if self.prefill_tps else None

    def record_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self.prefill_tps = _average(self.prefill_tps, tokens / seconds)

    def worth_waiting(self, read_pages: int, num_pages: int, page_bytes: int, page_size: int) -> bool:
        """Whether reading ``read_pages`` pages of ``page_bytes`` each is expected to take less time
        than computing the ``num_pages`` pages (``page_size`` tokens each) they are part of (they
        differ under CP, where each rank reads its own pages of the prefix)."""
        with self._lock:
            read_bps, prefill_tps = self.read_bps, self.prefill_tps
        compute_s = num_pages * page_size / prefill_tps if prefill_tps else float("inf")
        read_s = read_pages * page_bytes / read_bps if read_bps else 0.0
        return read_s < compute_s


def _average(old: float, sample: float) -> float:
    return sample if old == 0 else (1 - SMOOTHING) * old + SMOOTHING * sample
