"""A torch process doing bf16 matmuls on the CPU (where oneDNN picks AMX, if the CPU has it and
no cap holds it back). Its state is a step count and a tensor it keeps multiplying; SIGUSR1
writes "<steps> <sha256 of the tensor>" to argv[2]. ``--ref N`` prints that line after N steps
and exits: an uninterrupted reference for a restored process.
"""
import hashlib
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from pidio import write_atomic, write_pid_file  # noqa: E402

torch.set_num_threads(1)  # the same kernel and the same reduction order in the worker and its reference
g = torch.Generator().manual_seed(0)
x0 = torch.randn(64, 256, generator=g).bfloat16()
w = (torch.randn(256, 256, generator=g) * 0.06).bfloat16()


def digest(x) -> str:
    return hashlib.sha256(x.float().numpy().tobytes()).hexdigest()[:16]


if sys.argv[1] == "--ref":
    x = x0
    for _ in range(int(sys.argv[2])):
        x = torch.tanh(x @ w)
    print(f"{sys.argv[2]} {digest(x)}")
    sys.exit(0)

pid_file, out = sys.argv[1], sys.argv[2]
asked = False


def ask(*_):
    global asked
    asked = True


signal.signal(signal.SIGUSR1, ask)
x, steps = x0, 0
x = torch.tanh(x @ w)  # the first product before the pid file: the worker has chosen its kernel
steps = 1
write_pid_file(pid_file)
while True:
    if asked:  # answered between two products, so the digest is of a whole step
        asked = False
        write_atomic(out, f"{steps} {digest(x)}")
    x = torch.tanh(x @ w)
    steps += 1
