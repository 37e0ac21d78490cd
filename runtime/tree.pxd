# C-level view of DraftTree, shared with runtime/accept.pyx (which walks the tree without Python objects).
from libc.stdint cimport int32_t, int64_t, uint32_t


cdef struct Candidate:
    double score        # score(parent) + top_logp[depth-1, rank], in float64
    int64_t order       # global push counter: equal scores pop in push order
    int32_t parent      # node index of the parent
    int32_t depth       # 1..L
    int32_t rank        # 0..K-1, column in top_logp / top_ids


cdef class DraftTree:
    cdef readonly int capacity      # most non-root nodes this workspace holds
    cdef readonly int n             # non-root nodes in the current tree (the tree has n + 1 rows)
    cdef readonly int num_words     # uint32 words per visibility row = ceil((n + 1) / 32)

    # Backing numpy arrays sized for `capacity`; the public attributes are views of their first n + 1 rows.
    cdef object _tokens_buf, _depths_buf, _parents_buf, _scores_buf
    cdef object _first_child_buf, _next_sibling_buf, _visibility_buf
    cdef object _views              # (tokens, depths, parents, scores, first_child, next_sibling, visibility)
    cdef int _views_n               # the n the cached views were made for (-1: none)

    # Raw pointers into the backing arrays (valid for the object's lifetime).
    cdef int32_t* tokens_p
    cdef int32_t* depths_p
    cdef int32_t* parents_p
    cdef float* scores_p
    cdef int32_t* first_child_p     # -1: leaf
    cdef int32_t* next_sibling_p    # -1: last child; siblings are linked in rank order
    cdef uint32_t* visibility_p     # row-major [n + 1, num_words] for the current n

    # Scratch for the builder and the walk (malloc'd, not visible from Python).
    cdef double* node_score_p       # float64 node scores (children accumulate from these)
    cdef int32_t* last_child_p      # per node: its last child so far, to append to the sibling list
    cdef Candidate* heap_p          # binary max-heap of candidates, at most capacity + 1 entries
    cdef int32_t* path_p            # the walk's accepted path (capacity + 1 entries)

    cdef void _set_size(self, int n)
    cdef tuple _get_views(self)


# The data pointer of a writeable C-contiguous numpy array of that type and rank, else ValueError naming the caller:
# the round helpers (fill_verify_slots here, accept.pyx's fill_draft_head) write the CUDA engine's pinned views.
cdef void* writable_array(object a, str caller, str name, int typenum, int ndim) except NULL
