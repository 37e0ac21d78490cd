# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""DDTree draft tree: best-first builder over the drafter's per-position top-K, plus the DFlash chain.

The contract (DESIGN.md, "Contract: the tree"):
- Node 0 is the root (the previous bonus token): depth 0, parent -1, score 0; not counted in the budget.
- A node reached by ranks (r_1..r_d) scores sum_i top_logp[i-1, r_i], accumulated in float64.
- Best-first: pop the best candidate and give it the next node index; then push (a) its next sibling
  (same parent, rank + 1, if rank + 1 < K) and (b) its first child (depth + 1, rank 0, if depth < L).
  Stop after `budget` pops. Equal scores pop in push order (a global counter, the first candidate = 0).
- Nodes are numbered in pop order, so parent index < child index, and the children of a node are
  numbered in rank order.

Why this is fast: one validation pass over the inputs, then a C binary heap of plain structs in a
workspace allocated once (`out=`), no Python objects inside the loop. A pop and its first push share
one sift ("replace top"); the heap holds at most budget + 1 candidates.

Why every budget gives exactly `budget` nodes: the full tree has K + K^2 + ... + K^L >= L*K nodes and
budget <= L*K is enforced, so the heap never runs dry first. Graph buckets rely on this (fixed shapes).

Visibility: row i is a bitmask over nodes, bit j (word j >> 5, bit j & 31) set iff node j is node i or
an ancestor of it. It is built row by row: row(i) = row(parent(i)) | bit i.

During verify, node i sits at KV-cache slot prefix_len + i and position prefix_len + depths[i]
(see runtime.accept.commit_plan for the compaction that follows the walk).
"""
from libc.stdint cimport int32_t, int64_t, uint32_t, INT32_MAX
from libc.string cimport memcpy, memset
from libc.math cimport isfinite
from cpython.mem cimport PyMem_Malloc, PyMem_Free

import numpy as np
cimport numpy as cnp

cnp.import_array()

__all__ = ["DraftTree", "build_tree", "chain_tree", "fill_verify_slots"]


cdef class DraftTree:
    """A draft tree and the workspace it lives in, reusable across rounds (pass it as `out=`).

    `DraftTree(capacity)` allocates room for up to `capacity` non-root nodes. After a build it holds
    n + 1 nodes (node 0 = root) and exposes read-only numpy views of length n + 1:

    - tokens        int32   token of each node (tokens[0] = root token)
    - depths        int32   0 for the root, 1..L otherwise; verify position = prefix_len + depths[i]
    - parents       int32   parents[0] = -1; parents[i] < i
    - scores        float32 cumulative log-prob (float64 internally, rounded here; the chain has 0.0)
    - first_child   int32   first child of each node (-1: leaf)
    - next_sibling  int32   next child of the same parent, in rank order (-1: none)
    - visibility    uint32  [n + 1, num_words]: bit j of row i set iff j == i or j is an ancestor of i

    The views stay valid until the next build into this workspace overwrites them.
    A fresh workspace holds the root-only tree with token 0.
    """

    def __cinit__(self, int capacity):
        if capacity < 1:
            raise ValueError(f"DraftTree capacity must be >= 1, got {capacity}")
        cdef Py_ssize_t rows = <Py_ssize_t>capacity + 1
        cdef Py_ssize_t words = (rows + 31) >> 5
        self.capacity = capacity
        self._tokens_buf = np.zeros(rows, np.int32)
        self._depths_buf = np.zeros(rows, np.int32)
        self._parents_buf = np.full(rows, -1, np.int32)
        self._scores_buf = np.zeros(rows, np.float32)
        self._first_child_buf = np.full(rows, -1, np.int32)
        self._next_sibling_buf = np.full(rows, -1, np.int32)
        self._visibility_buf = np.zeros(rows * words, np.uint32)
        self.tokens_p = <int32_t*>cnp.PyArray_DATA(self._tokens_buf)
        self.depths_p = <int32_t*>cnp.PyArray_DATA(self._depths_buf)
        self.parents_p = <int32_t*>cnp.PyArray_DATA(self._parents_buf)
        self.scores_p = <float*>cnp.PyArray_DATA(self._scores_buf)
        self.first_child_p = <int32_t*>cnp.PyArray_DATA(self._first_child_buf)
        self.next_sibling_p = <int32_t*>cnp.PyArray_DATA(self._next_sibling_buf)
        self.visibility_p = <uint32_t*>cnp.PyArray_DATA(self._visibility_buf)
        self.node_score_p = <double*>PyMem_Malloc(rows * sizeof(double))
        self.last_child_p = <int32_t*>PyMem_Malloc(rows * sizeof(int32_t))
        self.heap_p = <Candidate*>PyMem_Malloc((rows + 1) * sizeof(Candidate))
        self.path_p = <int32_t*>PyMem_Malloc(rows * sizeof(int32_t))
        if not (self.node_score_p and self.last_child_p and self.heap_p and self.path_p):
            raise MemoryError(f"DraftTree: cannot allocate scratch for capacity {capacity}")
        self.visibility_p[0] = 1
        self._views = None
        self._views_n = -1
        self._set_size(0)

    def __dealloc__(self):
        PyMem_Free(self.node_score_p)
        PyMem_Free(self.last_child_p)
        PyMem_Free(self.heap_p)
        PyMem_Free(self.path_p)

    cdef void _set_size(self, int n):
        self.n = n
        self.num_words = (n + 32) >> 5

    cdef tuple _get_views(self):
        # Views are cached per n: in steady state (one budget per workspace) they are made once.
        cdef int rows
        if self._views_n != self.n:
            rows = self.n + 1
            views = [
                self._tokens_buf[:rows], self._depths_buf[:rows], self._parents_buf[:rows],
                self._scores_buf[:rows], self._first_child_buf[:rows], self._next_sibling_buf[:rows],
                self._visibility_buf[: rows * self.num_words].reshape(rows, self.num_words),
            ]
            for v in views:
                v.flags.writeable = False
            self._views = tuple(views)
            self._views_n = self.n
        return self._views

    @property
    def tokens(self):
        return self._get_views()[0]

    @property
    def depths(self):
        return self._get_views()[1]

    @property
    def parents(self):
        return self._get_views()[2]

    @property
    def scores(self):
        return self._get_views()[3]

    @property
    def first_child(self):
        return self._get_views()[4]

    @property
    def next_sibling(self):
        return self._get_views()[5]

    @property
    def visibility(self):
        return self._get_views()[6]

    @property
    def max_depth(self):
        cdef int i, d = 0
        for i in range(self.n + 1):
            if self.depths_p[i] > d:
                d = self.depths_p[i]
        return d

    def children(self, int node):
        """Node indices of the children of `node`, in rank order (a convenience; the walk uses C)."""
        if node < 0 or node > self.n:
            raise IndexError(f"node {node} out of range for a tree of {self.n + 1} nodes")
        out = []
        cdef int c = self.first_child_p[node]
        while c != -1:
            out.append(c)
            c = self.next_sibling_p[c]
        return out

    def __len__(self):
        return self.n + 1

    def __repr__(self):
        return f"DraftTree(nodes={self.n + 1}, max_depth={self.max_depth}, capacity={self.capacity})"


# ---------------------------------------------------------------- input checks

cdef inline bint _is_int_array(cnp.ndarray a) noexcept:
    cdef int t = cnp.PyArray_TYPE(a)
    return t == cnp.NPY_INT32 or t == cnp.NPY_INT64


cdef int _check_layout(object a, str name, int ndim) except -1:
    if not isinstance(a, cnp.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if cnp.PyArray_NDIM(<cnp.ndarray>a) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not (cnp.PyArray_ISALIGNED(<cnp.ndarray>a) and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>a)):
        raise ValueError(f"{name} must be aligned and in native byte order")
    return 0


cdef int32_t _check_token(object token, str name) except? -1:
    cdef int64_t t
    try:
        t = token
    except (TypeError, OverflowError):
        raise TypeError(f"{name} must be an integer token id, got {token!r}") from None
    if t < 0 or t > INT32_MAX:
        raise ValueError(f"{name} must be in [0, 2**31), got {t}")
    return <int32_t>t


cdef inline int64_t _read_id(const char* base, Py_ssize_t offset, bint is64) noexcept:
    if is64:
        return (<const int64_t*>(base + offset))[0]
    return (<const int32_t*>(base + offset))[0]


cdef int _check_logp_values(const char* lp, Py_ssize_t s0, Py_ssize_t s1, int L, int K) except -1:
    """Every entry finite and every row sorted descending (ties allowed)."""
    cdef int l, k
    cdef float v, prev
    cdef const char* row
    for l in range(L):
        row = lp + l * s0
        prev = (<const float*>row)[0]
        if not isfinite(prev):
            raise ValueError(f"top_logp[{l}, 0] is {prev}; log-probabilities must be finite")
        for k in range(1, K):
            v = (<const float*>(row + k * s1))[0]
            if not isfinite(v):
                raise ValueError(f"top_logp[{l}, {k}] is {v}; log-probabilities must be finite")
            if v > prev:
                raise ValueError(
                    f"top_logp row {l} is not sorted descending: column {k} ({v}) > column {k - 1} ({prev})")
            prev = v
    return 0


cdef DraftTree _workspace(DraftTree out, int n, str caller):
    if out is None:
        return DraftTree(n)
    if out.capacity < n:
        raise ValueError(f"{caller}: workspace capacity {out.capacity} < {n} nodes needed")
    return out


# ---------------------------------------------------------------- the heap

cdef inline bint _better(const Candidate* a, const Candidate* b) noexcept nogil:
    return a.score > b.score or (a.score == b.score and a.order < b.order)


cdef inline void _sift_down(Candidate* h, Py_ssize_t size, Py_ssize_t pos) noexcept nogil:
    cdef Candidate item = h[pos]
    cdef Py_ssize_t child
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and _better(&h[child + 1], &h[child]):
            child += 1
        if not _better(&h[child], &item):
            break
        h[pos] = h[child]
        pos = child
    h[pos] = item


cdef inline void _sift_up(Candidate* h, Py_ssize_t pos) noexcept nogil:
    cdef Candidate item = h[pos]
    cdef Py_ssize_t up
    while pos > 0:
        up = (pos - 1) >> 1
        if not _better(&item, &h[up]):
            break
        h[pos] = h[up]
        pos = up
    h[pos] = item


cdef inline void _start_tree(DraftTree t, int32_t root_token, int n) noexcept:
    """Root row and sizes for a tree of n non-root nodes."""
    t._set_size(n)
    t.tokens_p[0] = root_token
    t.depths_p[0] = 0
    t.parents_p[0] = -1
    t.scores_p[0] = 0.0
    t.node_score_p[0] = 0.0
    t.first_child_p[0] = -1
    t.next_sibling_p[0] = -1
    t.last_child_p[0] = -1
    memset(t.visibility_p, 0, t.num_words * sizeof(uint32_t))
    t.visibility_p[0] = 1


cdef inline void _add_node(DraftTree t, int i, int32_t token, int32_t depth, int32_t parent,
                           double score) noexcept:
    """Node i (parent < i, siblings added in rank order): arrays, sibling links, visibility row."""
    cdef int words = t.num_words
    cdef uint32_t* row = t.visibility_p + <Py_ssize_t>i * words
    t.tokens_p[i] = token
    t.depths_p[i] = depth
    t.parents_p[i] = parent
    t.scores_p[i] = <float>score
    t.node_score_p[i] = score
    t.first_child_p[i] = -1
    t.next_sibling_p[i] = -1
    t.last_child_p[i] = -1
    if t.last_child_p[parent] == -1:
        t.first_child_p[parent] = i
    else:
        t.next_sibling_p[t.last_child_p[parent]] = i
    t.last_child_p[parent] = i
    memcpy(row, t.visibility_p + <Py_ssize_t>parent * words, words * sizeof(uint32_t))
    row[i >> 5] |= (<uint32_t>1) << (i & 31)


cdef int _grow(DraftTree t, const char* lp, Py_ssize_t lp_s0, Py_ssize_t lp_s1,
               const char* ids, Py_ssize_t id_s0, Py_ssize_t id_s1, bint ids64,
               int L, int K, int budget) except -1:
    """The best-first loop. Returns the number of nodes popped (always `budget`, see module doc)."""
    cdef Candidate* heap = t.heap_p
    cdef Py_ssize_t size = 1
    cdef int64_t order = 1
    cdef int n = 0
    cdef int64_t token
    cdef Candidate c, nxt
    cdef bint replaced
    heap[0].score = (<const float*>lp)[0]
    heap[0].order = 0
    heap[0].parent = 0
    heap[0].depth = 1
    heap[0].rank = 0
    while n < budget and size > 0:
        c = heap[0]
        n += 1
        token = _read_id(ids, (c.depth - 1) * id_s0 + c.rank * id_s1, ids64)
        if token < 0 or token > INT32_MAX:
            raise ValueError(f"top_ids[{c.depth - 1}, {c.rank}] = {token} is not a valid token id")
        _add_node(t, n, <int32_t>token, c.depth, c.parent, c.score)
        # The popped slot is reused by the first push (one sift instead of two).
        replaced = False
        if c.rank + 1 < K:
            nxt.score = t.node_score_p[c.parent] + (<const float*>(lp + (c.depth - 1) * lp_s0
                                                                    + (c.rank + 1) * lp_s1))[0]
            nxt.order = order
            order += 1
            nxt.parent = c.parent
            nxt.depth = c.depth
            nxt.rank = c.rank + 1
            heap[0] = nxt
            _sift_down(heap, size, 0)
            replaced = True
        if c.depth < L:
            nxt.score = c.score + (<const float*>(lp + c.depth * lp_s0))[0]
            nxt.order = order
            order += 1
            nxt.parent = n
            nxt.depth = c.depth + 1
            nxt.rank = 0
            if replaced:
                heap[size] = nxt
                size += 1
                _sift_up(heap, size - 1)
            else:
                heap[0] = nxt
                _sift_down(heap, size, 0)
                replaced = True
        if not replaced:
            size -= 1
            if size > 0:
                heap[0] = heap[size]
                _sift_down(heap, size, 0)
    return n


# ---------------------------------------------------------------- public API

def build_tree(top_logp, top_ids, Py_ssize_t budget, root_token, DraftTree out=None):
    """Best-first DDTree over the drafter's top-K; returns a DraftTree with exactly budget + 1 nodes.

    top_logp: float32 [L, K], log-probabilities sorted descending per row, all finite.
    top_ids:  int32 or int64 [L, K], the token ids of those entries.
    budget:   non-root nodes to draft, 1 <= budget <= L*K.
    root_token: the root's token (the previous round's bonus token).
    out: a DraftTree workspace with capacity >= budget to fill in place (allocated when None).
    """
    _check_layout(top_logp, "top_logp", 2)
    _check_layout(top_ids, "top_ids", 2)
    if cnp.PyArray_TYPE(<cnp.ndarray>top_logp) != cnp.NPY_FLOAT32:
        raise TypeError(f"top_logp must be float32, got {top_logp.dtype}")
    if not _is_int_array(<cnp.ndarray>top_ids):
        raise TypeError(f"top_ids must be int32 or int64, got {top_ids.dtype}")
    cdef cnp.npy_intp* shape = cnp.PyArray_DIMS(<cnp.ndarray>top_logp)
    cdef Py_ssize_t L = shape[0], K = shape[1]
    if L < 1 or K < 1:
        raise ValueError(f"top_logp must have at least one row and column, got shape {top_logp.shape}")
    if cnp.PyArray_DIMS(<cnp.ndarray>top_ids)[0] != L or cnp.PyArray_DIMS(<cnp.ndarray>top_ids)[1] != K:
        raise ValueError(f"top_ids shape {top_ids.shape} != top_logp shape {top_logp.shape}")
    if budget < 1 or budget > L * K:
        raise ValueError(f"budget must be in [1, L*K] = [1, {L * K}] for L={L}, K={K}; got {budget}")
    cdef int32_t root = _check_token(root_token, "root_token")
    cdef DraftTree t = _workspace(out, <int>budget, "build_tree")

    cdef const char* lp = <const char*>cnp.PyArray_DATA(<cnp.ndarray>top_logp)
    cdef cnp.npy_intp* lps = cnp.PyArray_STRIDES(<cnp.ndarray>top_logp)
    cdef const char* ids = <const char*>cnp.PyArray_DATA(<cnp.ndarray>top_ids)
    cdef cnp.npy_intp* ids_s = cnp.PyArray_STRIDES(<cnp.ndarray>top_ids)
    _check_logp_values(lp, lps[0], lps[1], <int>L, <int>K)

    _start_tree(t, root, <int>budget)
    cdef int n
    try:
        n = _grow(t, lp, lps[0], lps[1], ids, ids_s[0], ids_s[1],
                  cnp.PyArray_TYPE(<cnp.ndarray>top_ids) == cnp.NPY_INT64, <int>L, <int>K, <int>budget)
    except BaseException:
        _start_tree(t, root, 0)  # never leave a half-built tree in a reused workspace
        raise
    if n != budget:  # impossible while budget <= L*K; kept so a broken invariant cannot pass silently
        raise RuntimeError(f"build_tree popped {n} nodes, expected {budget}")
    return t


def chain_tree(tokens, root_token, DraftTree out=None):
    """The DFlash chain as a DraftTree: root -> tokens[0] -> tokens[1] -> ... (depth = len(tokens)).

    tokens: int32 or int64 [L], the drafter's argmax token per position. Scores are 0.0 (no log-probs).
    Same arrays as build_tree, so verify, walk and commit treat both alike.
    """
    _check_layout(tokens, "tokens", 1)
    if not _is_int_array(<cnp.ndarray>tokens):
        raise TypeError(f"tokens must be int32 or int64, got {tokens.dtype}")
    cdef Py_ssize_t L = cnp.PyArray_DIMS(<cnp.ndarray>tokens)[0]
    if L < 1:
        raise ValueError("tokens must hold at least one token")
    cdef int32_t root = _check_token(root_token, "root_token")
    cdef DraftTree t = _workspace(out, <int>L, "chain_tree")
    cdef const char* data = <const char*>cnp.PyArray_DATA(<cnp.ndarray>tokens)
    cdef Py_ssize_t stride = cnp.PyArray_STRIDES(<cnp.ndarray>tokens)[0]
    cdef bint is64 = cnp.PyArray_TYPE(<cnp.ndarray>tokens) == cnp.NPY_INT64
    cdef int64_t token
    cdef int i
    _start_tree(t, root, <int>L)
    for i in range(1, L + 1):
        token = _read_id(data, (i - 1) * stride, is64)
        if token < 0 or token > INT32_MAX:
            _start_tree(t, root, 0)
            raise ValueError(f"tokens[{i - 1}] = {token} is not a valid token id")
        _add_node(t, i, <int32_t>token, i, i - 1, 0.0)
    return t


cdef void* writable_array(object a, str caller, str name, int typenum, int ndim) except NULL:
    if not (isinstance(a, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>a) == typenum
            and cnp.PyArray_NDIM(<cnp.ndarray>a) == ndim and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>a)):
        raise ValueError(f"{caller}: {name} must be a writeable C-contiguous {ndim}-D numpy array of "
                         f"{cnp.PyArray_DescrFromType(typenum)}")
    return cnp.PyArray_DATA(<cnp.ndarray>a)


def fill_verify_slots(DraftTree tree, ids, pos, vis, int start):
    """Write `tree` into one verify bucket's inputs of T slots (the CUDA engine's pinned state block): slot i < n + 1
    gets node i's token, position start + depth and visibility row (zero past the tree's words); a padded slot
    i >= n + 1 gets token 0 at position start, seeing only itself. ids, pos: int32 [T]; vis: uint32 [T, W] with
    T >= n + 1 and W >= both the tree's words and ceil(T / 32). (The numpy writes it replaces cost ~2.7 us a round
    on the development machine at budget 64, this 0.3 us.)"""
    cdef int32_t* ids_p = <int32_t*>writable_array(ids, "fill_verify_slots", "ids", cnp.NPY_INT32, 1)
    cdef int32_t* pos_p = <int32_t*>writable_array(pos, "fill_verify_slots", "pos", cnp.NPY_INT32, 1)
    cdef uint32_t* vis_p = <uint32_t*>writable_array(vis, "fill_verify_slots", "vis", cnp.NPY_UINT32, 2)
    cdef Py_ssize_t T = cnp.PyArray_DIMS(<cnp.ndarray>ids)[0], W = cnp.PyArray_DIMS(<cnp.ndarray>vis)[1]
    cdef int rows = tree.n + 1, words = tree.num_words
    if cnp.PyArray_DIMS(<cnp.ndarray>pos)[0] != T or cnp.PyArray_DIMS(<cnp.ndarray>vis)[0] != T:
        raise ValueError(f"fill_verify_slots: ids {ids.shape}, pos {pos.shape} and vis {vis.shape} must have one "
                         "row per slot")
    if T < rows or W < words or W * 32 < T:
        raise ValueError(f"fill_verify_slots: a tree of {rows} rows x {words} words does not fit {T} slots x {W} "
                         f"words (or {W} words cannot hold {T} slots)")
    cdef Py_ssize_t i
    for i in range(rows):
        ids_p[i] = tree.tokens_p[i]
        pos_p[i] = start + tree.depths_p[i]
    if W == words:   # the tree's rows are the slots' rows: one copy
        memcpy(vis_p, tree.visibility_p, rows * words * sizeof(uint32_t))
    else:
        for i in range(rows):
            memcpy(vis_p + i * W, tree.visibility_p + i * words, words * sizeof(uint32_t))
            memset(vis_p + i * W + words, 0, (W - words) * sizeof(uint32_t))
    if rows < T:
        memset(vis_p + rows * W, 0, (T - rows) * W * sizeof(uint32_t))
    for i in range(rows, T):
        ids_p[i] = 0
        pos_p[i] = start
        vis_p[i * W + (i >> 5)] = (<uint32_t>1) << (i & 31)
