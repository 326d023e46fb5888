/*
 * The allocation functions of vmmd's CuPy allocator, called by
 * cupy.cuda.memory.CFunctionAllocator from Cython with no Python in between:
 * a pure-Python malloc costs several microseconds more than CuPy's own pool,
 * these cost a mutex and a lookup. The chunks and spans are those of the
 * PyTorch library (_torch_allocator.c, included: this library has its own
 * copy of that state); the Python side (vmmd._cupy_chunks) leases chunks and
 * hands them over with vmmd_cupy_add_chunk.
 *
 * CuPy calls malloc and free holding the GIL, so malloc never waits: with no
 * room it answers NULL at once and the Python caller leases a chunk on its own
 * thread, then asks again. Reuse is stream-ordered as in CuPy's MemoryPool:
 * a block freed is held for the stream it was allocated on (the one CuPy
 * considered current at malloc, read through CuPy's C API:
 * cupy.cuda.stream's get_current_stream_ptr, which needs the GIL: it is held)
 * and reused at once by later work on that stream; other streams get it only
 * once the device has finished its work (vmmd_cupy_release_held, after a
 * synchronize: on trim and out of memory). No event is ever recorded on a
 * stream after the fact: CuPy destroys a Stream whose arrays may live on,
 * and an event recorded on a destroyed stream is undefined behaviour.
 *
 * Requests round up to size classes (512-byte multiples, then quarters of a
 * power of two) so that a freed block fits the next request like it; held
 * blocks are indexed by (stream, size class): the common malloc is one hash
 * lookup. Small requests never split a chunk leased for a large one.
 */
#include "_torch_allocator.c"

typedef intptr_t (*current_stream_fn)(void);

#define HELD_BUCKETS 4096
/* A chunk's last_use while used since the last stamp: mallocs and frees never read the clock (on some
 * hosts clock_gettime is a system call, microseconds each); vmmd_cupy_stamp puts the time in. */
#define TOUCHED 1e300

static current_stream_fn current_stream;
/* Requests above it are large: they may take a chunk leased for one of them (`own`), the others never do. */
static uint64_t large_threshold = UINT64_MAX;

/* The held blocks by (stream, size), newest first. Invariant: every HELD span has a node; a node
 * whose span is no longer HELD for that stream and size (its chunk gone, reused) is dropped when met. */
typedef struct {
  void *stream;
  uint64_t size, address;
  int device, next;
} held_node_t;
static int held_heads[HELD_BUCKETS];
static held_node_t *held_nodes;
static int held_capacity, held_spare = -1, held_ready;

void vmmd_cupy_configure(void *stream_getter, uint64_t large) {
  pthread_mutex_lock(&lock);
  current_stream = (current_stream_fn)stream_getter;
  large_threshold = large;
  pthread_mutex_unlock(&lock);
}

/* The size a request really takes (pool.py's size_class with this library's alignment). */
uint64_t vmmd_cupy_size_class(uint64_t size) {
  if (size <= ALIGNMENT) return ALIGNMENT;
  uint64_t power = 1;
  while (power * 2 < size) power *= 2;
  uint64_t step = power / 4 > ALIGNMENT ? power / 4 : ALIGNMENT;
  return (size + step - 1) / step * step;
}

static unsigned held_bucket(void *stream, uint64_t size) {
  uint64_t key = (uint64_t)(uintptr_t)stream * 0x9E3779B97F4A7C15ull ^ (size >> 9) * 0xC2B2AE3D27D4EB4Full;
  return (unsigned)(key >> 40) & (HELD_BUCKETS - 1);
}

static void held_clear(void) {
  for (int b = 0; b < HELD_BUCKETS; b++) held_heads[b] = -1;
  held_spare = -1;
  for (int n = held_capacity - 1; n >= 0; n--) {
    held_nodes[n].next = held_spare;
    held_spare = n;
  }
  held_ready = 1;
}

static int held_push(int device, void *stream, uint64_t size, uint64_t address) {
  if (!held_ready) held_clear();
  if (held_spare < 0) {
    int capacity = held_capacity ? held_capacity * 2 : 256;
    held_node_t *grown = realloc(held_nodes, sizeof(held_node_t) * (size_t)capacity);
    if (grown == NULL) return -1;
    held_nodes = grown;
    for (int n = capacity - 1; n >= held_capacity; n--) {
      held_nodes[n].next = held_spare;
      held_spare = n;
    }
    held_capacity = capacity;
  }
  int n = held_spare;
  held_spare = held_nodes[n].next;
  unsigned b = held_bucket(stream, size);
  held_nodes[n] = (held_node_t){stream, size, address, device, held_heads[b]};
  held_heads[b] = n;
  return 0;
}

/* The span at `address`, as chunk k, span i (-1: none). */
static int span_at(uint64_t address, int *k_out) {
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (address < c->base || address >= c->base + c->size) continue;
    int low = 0, high = c->count - 1;
    uint64_t offset = address - c->base;
    while (low <= high) {
      int middle = (low + high) / 2;
      if (c->spans[middle].offset == offset) {
        *k_out = k;
        return middle;
      }
      if (c->spans[middle].offset < offset) low = middle + 1;
      else high = middle - 1;
    }
    return -1;
  }
  return -1;
}

/* Whether `address` lies in a chunk that is asleep (unmapped until it wakes; its nodes stay). */
static int asleep_at(uint64_t address) {
  for (int k = 0; k < chunk_count; k++) {
    if (address >= chunks[k].base && address < chunks[k].base + chunks[k].size) return chunks[k].asleep;
  }
  return 0;
}

/* A block `stream` freed, of exactly `size` bytes, now USED again; NULL when none. */
static void *held_take(int device, uint64_t size, void *stream) {
  if (!held_ready) return NULL;
  unsigned b = held_bucket(stream, size);
  for (int *link = &held_heads[b]; *link >= 0;) {
    held_node_t *node = &held_nodes[*link];
    if (node->stream != stream || node->size != size || node->device != device || asleep_at(node->address)) {
      link = &node->next;
      continue;
    }
    int n = *link, k, i = span_at(node->address, &k);
    uint64_t address = node->address;
    *link = node->next;
    held_nodes[n].next = held_spare;
    held_spare = n;
    if (i < 0) continue;
    chunk_t *c = &chunks[k];
    span_t *s = &c->spans[i];
    if (s->state != SPAN_HELD || s->stream != stream || s->size != size) continue;
    s->state = SPAN_USED;
    c->freed = 0;
    counters[2]++;
    return (void *)(uintptr_t)address;
  }
  return NULL;
}

/* The smallest FREE span that fits `size`, as chunk k, span i (-1: none). */
static int best_free(int device, uint64_t size, int large, int *k_out) {
  int best_k = -1, best_i = -1;
  uint64_t best_size = UINT64_MAX;
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->device != device || c->asleep || (!large && c->own) || c->size < size) continue;
    for (int i = 0; i < c->count; i++) {
      span_t *s = &c->spans[i];
      if (s->state != SPAN_FREE || s->size < size || s->size >= best_size) continue;
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

/* Makes [offset, +size) of FREE span i USED for `stream` (the core's take, without the clock). */
static void *take_free(chunk_t *c, int i, uint64_t size, void *stream) {
  span_t *s = &c->spans[i];
  if (s->size > size) {
    span_t rest = {s->offset + size, s->size - size, SPAN_FREE, NULL, NULL};
    if (insert_span(c, i + 1, rest) != 0) return NULL;
    s = &c->spans[i];
  }
  s->size = size;
  s->state = SPAN_USED;
  s->stream = stream;
  s->event = NULL;
  room[SLOT(c->tag, c->device)] -= size;
  c->freed = 0;
  c->last_use = TOUCHED;
  return (void *)(uintptr_t)(c->base + s->offset);
}

/* CFunctionAllocator's malloc: a block, or NULL when no chunk has room for it (never a wait). */
void *vmmd_cupy_malloc(void *param, size_t requested, int device) {
  (void)param;
  if (requested == 0 || device < 0 || device >= MAX_DEVICES) return NULL;
  void *stream = current_stream != NULL ? (void *)current_stream() : NULL;
  uint64_t size = vmmd_cupy_size_class(requested);
  pthread_mutex_lock(&lock);
  counters[0]++;
  void *found = held_take(device, size, stream);
  if (found == NULL) {
    int k, i = best_free(device, size, size > large_threshold, &k);
    if (i >= 0) found = take_free(&chunks[k], i, size, stream);
  }
  if (found == NULL) counters[4]++;
  pthread_mutex_unlock(&lock);
  return found;
}

/* CFunctionAllocator's free: the block is held for the stream it was allocated on. */
void vmmd_cupy_free(void *param, void *pointer, int device) {
  (void)param;
  (void)device;
  pthread_mutex_lock(&lock);
  counters[1]++;
  int k, i = span_at((uint64_t)(uintptr_t)pointer, &k);
  span_t *s = i >= 0 ? &chunks[k].spans[i] : NULL;
  if (s != NULL && s->state == SPAN_USED) {
    /* Without host memory for its node the block is reused only once the held blocks are released. */
    held_push(chunks[k].device, s->stream, s->size, (uint64_t)(uintptr_t)pointer);
    s->state = SPAN_HELD;
    s->event = NULL; /* not marked: freed after the last vmmd_cupy_mark_held */
    chunks[k].last_use = TOUCHED;
  } else {
    counters[7]++;
  }
  pthread_mutex_unlock(&lock);
}

/* Puts the time (`ancient`: long ago) into the last_use of the chunks used since the last stamp:
 * before vmmd_take_empty_chunk, which never takes a chunk still TOUCHED. */
void vmmd_cupy_stamp(int ancient) {
  pthread_mutex_lock(&lock);
  double t = ancient ? 0.0 : now();
  for (int k = 0; k < chunk_count; k++) {
    if (chunks[k].last_use == TOUCHED) chunks[k].last_use = t;
  }
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

/* A held span's `event` (no event is recorded in this library) marks it held before a synchronize. */
#define HELD_MARK ((void *)1)

/* Marks every held block: vmmd_cupy_release_held frees these and no block freed later. */
void vmmd_cupy_mark_held(void) {
  pthread_mutex_lock(&lock);
  for (int k = 0; k < chunk_count; k++) {
    for (int i = 0; i < chunks[k].count; i++) {
      if (chunks[k].spans[i].state == SPAN_HELD) chunks[k].spans[i].event = HELD_MARK;
    }
  }
  pthread_mutex_unlock(&lock);
}

/* Every block held and marked becomes free for every stream: the caller marked them, then
 * synchronized their devices, so the work queued before their frees is done. Returns the bytes. */
uint64_t vmmd_cupy_release_held(void) {
  uint64_t released = 0;
  pthread_mutex_lock(&lock);
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    if (c->asleep) continue;
    for (int i = 0; i < c->count; i++) {
      if (c->spans[i].state != SPAN_HELD || c->spans[i].event != HELD_MARK) continue;
      c->spans[i].event = NULL;
      c->spans[i].state = SPAN_FREE;
      room[SLOT(c->tag, c->device)] += c->spans[i].size;
      released += c->spans[i].size;
    }
    coalesce(c);
  }
  /* Their nodes are dropped when met. */
  pthread_mutex_unlock(&lock);
  return released;
}

/* Drops the index's nodes whose block is gone (chunks taken back) and indexes what is held. */
void vmmd_cupy_reindex(void) {
  pthread_mutex_lock(&lock);
  held_clear();
  for (int k = 0; k < chunk_count; k++) {
    chunk_t *c = &chunks[k];
    for (int i = 0; i < c->count; i++) {
      span_t *s = &c->spans[i];
      if (s->state == SPAN_HELD) held_push(c->device, s->stream, s->size, c->base + s->offset);
    }
  }
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
