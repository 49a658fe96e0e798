"""Progress of a preprocessing run: a tqdm bar on a terminal, Megatron's log lines otherwise.

MB here are 10**6 bytes of input read (JSON text), per second of wall time.
"""
import shutil
import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total_bytes=None, total_docs=None, log_interval=100, stream=None):
        self.stream = stream or sys.stderr
        self.start = time.time()
        self.docs = 0
        self.bytes = 0
        self.log_interval = log_interval
        self._next_log = log_interval
        self._last_postfix = 0.0
        by_bytes = total_bytes is not None
        # disable=None: a bar only on a terminal; logs and CI get plain lines.
        self.bar = tqdm(total=total_bytes if by_bytes else total_docs, unit="B" if by_bytes else "docs",
                        unit_scale=True, unit_divisor=1000, disable=None, file=self.stream,
                        desc="tokenizing", mininterval=0.5,
                        ncols=shutil.get_terminal_size(fallback=(100, 24)).columns or 100)
        self._by_bytes = by_bytes
        if self.bar.disable:
            self.bar = None

    def rates(self):
        elapsed = max(time.time() - self.start, 1e-9)
        return self.docs / elapsed, self.bytes / elapsed / 1e6

    def update(self, docs, nbytes):
        self.docs += docs
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes if self._by_bytes else docs)
            now = time.time()
            if now - self._last_postfix > 0.5:
                docs_s, mb_s = self.rates()
                # tqdm already shows the rate of its own unit; add the other one.
                extra = f"{docs_s:.0f} docs/s" if self._by_bytes else f"{mb_s:.2f} MB/s"
                self.bar.set_postfix_str(extra, refresh=False)
                self._last_postfix = now
        elif self.log_interval and self.docs >= self._next_log:
            docs_s, mb_s = self.rates()
            print(f"Processed {self.docs} documents ({docs_s:.1f} docs/s, {mb_s:.2f} MB/s).",
                  file=self.stream, flush=True)
            while self._next_log <= self.docs:
                self._next_log += self.log_interval

    def set_totals(self, docs, nbytes):
        """For sources that report cumulative counts (the many-cores tool)."""
        if docs > self.docs or nbytes > self.bytes:
            self.update(docs - self.docs, nbytes - self.bytes)

    def close(self, summary=True):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not summary:
            return None
        elapsed = time.time() - self.start
        docs_s, mb_s = self.rates()
        print(f"Done: {self.docs} documents, {self.bytes / 1e6:.2f} MB in {elapsed:.2f} s "
              f"({docs_s:.1f} docs/s, {mb_s:.2f} MB/s).", file=self.stream, flush=True)
        return {"docs": self.docs, "bytes": self.bytes, "seconds": elapsed, "mb_per_s": mb_s}
