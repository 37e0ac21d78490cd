"""CUDA graphs: capture a stream region, instantiate once, replay; change kernel arguments (scalars or
buffer pointers) of an instantiated graph without capturing again; a cache of graphs keyed by bucket.

While a capture is active on a stream, every Launch on that stream is recorded with the graph node it
became (read back with cuStreamGetCaptureInfo), so `GraphExec.update_kernel_args(i, ...)` can patch the
i-th captured kernel with one cuGraphExecKernelNodeSetParams.
"""
from __future__ import annotations

from .device import driver, get_device
from .errors import check
from .stream import stream_handle

_active: dict[int, "Capture"] = {}  # int(stream handle) -> capture in progress on it
_deferred: list = []  # (release fn, handle) dropped while a capture ran, released after the last one ends


def release(destroy, handle):
    """destroy(handle) now, or once no capture is in progress. cuMemFree, cuMemFreeHost and cuGraph(Exec)Destroy
    synchronize implicitly: made while a stream captures (a garbage collection can run any finalizer there), they
    invalidate the capture, and its next launch fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED."""
    if _active:
        _deferred.append((destroy, handle))
    else:
        _destroy_quietly(destroy, handle)


def _destroy_quietly(destroy, handle):
    try:
        destroy(handle)
    except Exception:  # interpreter shutdown
        pass


def _release_deferred():
    """Release what release() held back, once the last capture has ended."""
    while _deferred and not _active:
        _destroy_quietly(*_deferred.pop())


def _note_launch(stream, launch):
    """Called by Launch after cuLaunchKernel while any capture is active. A launch on a stream the capture forked
    (one that waited on an event recorded inside it) belongs to that capture too: found by its capture id."""
    cap = _active.get(int(stream))
    drv = driver()
    info = check(drv.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")
    if cap is None:
        if info[0] != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            return
        cap = next((c for c in _active.values() if c.capture_id == int(info[1])), None)
        if cap is None:
            return
    deps = info[3]  # (status, id, graph, dependencies, edge data, count): the node just added
    if not deps:
        raise RuntimeError("graph capture: the launched kernel left no node to record")
    from .kernel import Launch
    copy = Launch(launch.kernel, launch.grid, launch.block, launch.args, launch.smem)  # never aliased
    cap.launches.append(copy)
    cap.nodes.append(deps[-1])


def _node_params(lp):
    """CUDA_KERNEL_NODE_PARAMS for a Launch. kernelParams points at the Launch's own address array, so
    after set_arg the same struct is valid again; the driver copies the values at each update."""
    p = driver().CUDA_KERNEL_NODE_PARAMS()
    p.func = lp.kernel.function
    p.gridDimX, p.gridDimY, p.gridDimZ = lp.grid
    p.blockDimX, p.blockDimY, p.blockDimZ = lp.block
    p.sharedMemBytes = lp.smem
    p.kernelParams = lp.params
    p.extra = 0
    return p


class Capture:
    def __init__(self, stream=None):
        get_device()
        self.stream = stream
        self.handle = stream_handle(stream)
        self.graph = None
        self.capture_id = None  # the driver's id of the capture, while it runs
        self.launches: list = []  # Launch copies, in capture order (forked streams' included)
        self.nodes: list = []  # their graph nodes

    def __enter__(self):
        drv = driver()
        if int(self.handle) in _active:
            raise RuntimeError("a capture is already active on this stream")
        check(drv.cuStreamBeginCapture(self.handle,
                                       drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        self.capture_id = int(check(drv.cuStreamGetCaptureInfo(self.handle), "cuStreamGetCaptureInfo")[1])
        _active[int(self.handle)] = self
        return self

    def __exit__(self, exc_type, exc, tb):
        _active.pop(int(self.handle), None)
        result = driver().cuStreamEndCapture(self.handle)
        _release_deferred()
        if exc_type is not None:  # the body failed: end the capture, drop the graph, keep the body's error
            if int(result[0]) == 0 and result[1] is not None:
                driver().cuGraphDestroy(result[1])
            return False
        self.graph = check(result, "cuStreamEndCapture")
        return False

    def instantiate(self) -> "GraphExec":
        if self.graph is None:
            raise RuntimeError("instantiate() before the capture ended")
        return GraphExec(self)

    def __del__(self):
        if getattr(self, "graph", None) is not None:
            release(driver().cuGraphDestroy, self.graph)


def capture(stream=None) -> Capture:
    """`with capture(stream) as g: ...launches on stream...` then `g.instantiate()`."""
    return Capture(stream)


class GraphExec:
    def __init__(self, cap: Capture):
        self.capture = cap  # keeps the graph, its nodes and the launch copies alive
        # kernel nodes keep the priority of the stream they were captured on (streams made with a priority: the
        # block scheduler's pick among grids queued at once), not the priority of the stream the graph is launched on
        flags = int(driver().CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)
        self.handle = check(driver().cuGraphInstantiate(cap.graph, flags), "cuGraphInstantiate")
        self.launches = cap.launches
        self._params = [None] * len(cap.launches)  # node parameter structs, built on first update

    @property
    def num_kernels(self) -> int:
        return len(self.launches)

    def launch(self, stream=None):
        check(driver().cuGraphLaunch(self.handle, stream_handle(stream)), "cuGraphLaunch")

    __call__ = launch

    def update_kernel_args(self, index: int, args=None, grid=None, block=None):
        """Patch the index-th captured kernel: args is a full list, or {arg position: value}; grid/block
        may change too. Applies to the next replay; nothing is captured again."""
        lp = self.launches[index]
        if args is not None:
            items = args.items() if isinstance(args, dict) else enumerate(args)
            for i, v in items:
                lp.set_arg(i, v)
        p = self._params[index]
        if p is None or grid is not None or block is not None:
            from .kernel import _dim3
            lp.grid = _dim3(grid) if grid is not None else lp.grid
            lp.block = _dim3(block) if block is not None else lp.block
            lp._bind()
            p = self._params[index] = _node_params(lp)
        check(driver().cuGraphExecKernelNodeSetParams(self.handle, self.capture.nodes[index], p),
              "cuGraphExecKernelNodeSetParams")

    def __del__(self):
        release(driver().cuGraphExecDestroy, self.handle)


def bucket_for(n: int, buckets) -> int:
    """The smallest bucket >= n (graphs are captured per bucket, padded slots masked out)."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {max(buckets)}")


class GraphCache:
    """Instantiated graphs keyed by bucket (e.g. tree budget): captured on first use, replayed after."""

    def __init__(self, stream=None):
        self.stream = stream
        self.graphs: dict = {}

    def get(self, bucket, record):
        """The graph for `bucket`; on a miss, `record(bucket, stream)` enqueues the work to capture."""
        g = self.graphs.get(bucket)
        if g is None:
            with capture(self.stream) as cap:
                record(bucket, self.stream)
            g = self.graphs[bucket] = cap.instantiate()
        return g

    def launch(self, bucket, record=None, stream=None):
        g = self.graphs[bucket] if record is None else self.get(bucket, record)
        g.launch(stream if stream is not None else self.stream)
        return g

    def __contains__(self, bucket):
        return bucket in self.graphs

    def __len__(self):
        return len(self.graphs)

    def clear(self):
        self.graphs.clear()
