/*
 * The allocation functions of vmmd's CuPy allocator, called by
 * cupy.cuda.memory.CFunctionAllocator from Cython with no Python in between:
 * a pure-Python malloc costs several microseconds more than CuPy's own pool,
 * these cost a mutex and a scan of the chunks. The chunks, spans and events are
 * those of the PyTorch library (_torch_allocator.c, included: this library has
 * its own copy of that state); the Python side (vmmd._cupy_chunks) leases
 * chunks and hands them over with vmmd_add_chunk.
 *
 * CuPy calls malloc and free holding the GIL, so malloc never waits: with no
 * room it answers NULL at once and the Python caller leases a chunk on its own
 * thread, then asks again. The stream whose order a block follows is the one
 * CuPy considers current at malloc, read through CuPy's C API
 * (cupy.cuda.stream's get_current_stream_ptr, which needs the GIL: it is held).
 * A block freed is reused at once by its stream, by others once an event
 * recorded on that stream after the free is done; requests round up to size
 * classes (512-byte multiples, then quarters of a power of two) so that a
 * freed block fits the next request like it; small requests never split a
 * chunk leased for a large one, so it stays whole for the next large one.
 */
#include "_torch_allocator.c"

typedef intptr_t (*current_stream_fn)(void);

static current_stream_fn current_stream;
/* Requests above it are large: they may take a chunk leased for one of them (`own`), the others never do. */
static uint64_t large_threshold = UINT64_MAX;

void vmmd_cupy_configure(void *stream_getter, uint64_t large) {
  pthread_mutex_lock(&lock);
  current_stream = (current_stream_fn)stream_getter;
  large_threshold = large;
  pthread_mutex_unlock(&lock);
}

/* vmmd_add_chunk, the chunk marked `own` when leased for a large request. */
int vmmd_cupy_add_chunk(int device, uint64_t base, uint64_t size, int own) {
  if (vmmd_add_chunk(device, base, size) != 0) return -1;
  pthread_mutex_lock(&lock);
  for (int k = 0; k < chunk_count; k++) {
    if (chunks[k].base == base) chunks[k].own = own;
  }
  pthread_mutex_unlock(&lock);
  return 0;
}

/* The size a request really takes (pool.py's size_class with this library's alignment). */
uint64_t vmmd_cupy_size_class(uint64_t size) {
  if (size <= ALIGNMENT) return ALIGNMENT;
  uint64_t power = 1;
  while (power * 2 < size) power *= 2;
  uint64_t step = power / 4 > ALIGNMENT ? power / 4 : ALIGNMENT;
  return (size + step - 1) / step * step;
}

/* The smallest span in `state` (for HELD: freed on `stream`) that fits `size`, as chunk k, span i. */
static int best_fit(int device, uint64_t size, int large, int state, void *stream, int *k_out) {
  int best_k = -1, best_i = -1;
  uint64_t best_size = UINT64_MAX;
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->device != device || (!large && c->own) || c->size < size) continue;
    for (int i = 0; i < c->count; i++) {
      span_t *s = &c->spans[i];
      if (s->state != state || s->size < size || s->size >= best_size) continue;
      if (state == SPAN_HELD && s->stream != stream) continue;
      best_k = k;
      best_i = i;
      best_size = s->size;
      if (best_size == size) break;
    }
    if (best_size == size) break;
  }
  *k_out = best_k;
  return best_i;
}

static void *carve_fitting(int device, uint64_t size, int large, void *stream) {
  int k, i = best_fit(device, size, large, SPAN_HELD, stream, &k);
  if (i >= 0) {
    counters[2]++;
    return take(&chunks[k], i, size, stream);
  }
  i = best_fit(device, size, large, SPAN_FREE, NULL, &k);
  return i >= 0 ? take(&chunks[k], i, size, stream) : NULL;
}

static int any_held(int device) {
  for (int k = 0; k < chunk_count; k++) {
    if (chunks[k].device != device) continue;
    for (int i = 0; i < chunks[k].count; i++) {
      if (chunks[k].spans[i].state == SPAN_HELD) return 1;
    }
  }
  return 0;
}

/* CFunctionAllocator's malloc: a block, or NULL when no chunk has room (never a wait). */
void *vmmd_cupy_malloc(void *param, size_t requested, int device) {
  (void)param;
  if (requested == 0 || device < 0 || device >= MAX_DEVICES) return NULL;
  void *stream = current_stream != NULL ? (void *)current_stream() : NULL;
  uint64_t size = vmmd_cupy_size_class(requested);
  int large = size > large_threshold;
  pthread_mutex_lock(&lock);
  counters[0]++;
  void *found = carve_fitting(device, size, large, stream);
  if (found == NULL && any_held(device)) {
    /* Blocks other streams freed whose work is done; never a wait (streams would run one after the other). */
    settle(device, 0);
    found = carve_fitting(device, size, large, stream);
  }
  if (found == NULL) counters[4]++;
  pthread_mutex_unlock(&lock);
  return found;
}

/* CFunctionAllocator's free: the block is held for the stream it was allocated for. */
void vmmd_cupy_free(void *param, void *pointer, int device) {
  (void)param;
  (void)device;
  uint64_t address = (uint64_t)(uintptr_t)pointer;
  pthread_mutex_lock(&lock);
  counters[1]++;
  int known = 0;
  for (int k = 0; k < chunk_count && !known; k++) {
    chunk_t *c = &chunks[k];
    if (address < c->base || address >= c->base + c->size) continue;
    int low = 0, high = c->count - 1;
    uint64_t offset = address - c->base;
    while (low <= high) {
      int middle = (low + high) / 2;
      span_t *s = &c->spans[middle];
      if (s->offset == offset) {
        if (s->state == SPAN_USED) {
          s->state = SPAN_HELD;
          s->event = NULL;
          known = 1;
        }
        break;
      }
      if (s->offset < offset) low = middle + 1;
      else high = middle - 1;
    }
    c->last_use = now();
    break;
  }
  if (!known) counters[7]++;
  pthread_mutex_unlock(&lock);
}

/* Of the device's chunks: count, bytes, bytes and blocks in use, bytes and blocks held for a stream. */
void vmmd_cupy_stats(int device, uint64_t *out) {
  memset(out, 0, sizeof(uint64_t) * 6);
  pthread_mutex_lock(&lock);
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->device != device) continue;
    out[0]++;
    out[1] += c->size;
    for (int i = 0; i < c->count; i++) {
      if (c->spans[i].state == SPAN_USED) {
        out[2] += c->spans[i].size;
        out[3]++;
      } else if (c->spans[i].state == SPAN_HELD) {
        out[4] += c->spans[i].size;
        out[5]++;
      }
    }
  }
  pthread_mutex_unlock(&lock);
}
