"""GPU time of calls replayed in a CUDA graph, as SGLang's decode graphs run them (no host launch cost)."""

import torch


def graph_us(calls, reps: int = 20) -> float:
    """Median microseconds per call inside one CUDA graph that runs every zero-argument call once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:
            f()  # compile / JIT / autotune outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]
