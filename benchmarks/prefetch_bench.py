"""The prefetch measurement of docs/perf.md (2 GPUs): a 64K-token cached prefix, then a 4096-token
extend, with and without the side-stream prefetch. Writes $OUT/prefetch.json (or ./prefetch.json)."""

import json
import os
import tempfile
from pathlib import Path

from cpkv.bench import gpu
from cpkv.cli.bench import DEEPSEEK_STACK
from cpkv.models import write_tiny_checkpoint
from cpkv.runtime import run_ranks

if __name__ == "__main__":
    ckpt = Path(tempfile.mkdtemp()) / "stack"
    write_tiny_checkpoint(ckpt, seed=0, num_hidden_layers=2, first_k_dense_replace=2,
                          **DEEPSEEK_STACK)
    res = run_ranks(gpu.prefetch_rank, 2, args=(gpu.PrefetchSpec(str(ckpt), 65536, 4096),),
                    backend="nccl", timeout_s=500)
    vals = [r.value for r in res]
    out = Path(os.environ.get("OUT", ".")) / "prefetch.json"
    out.write_text(json.dumps(vals, indent=1))
    print(json.dumps(vals, indent=1))
