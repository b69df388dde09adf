// A stand-in CUDA driver, NVRTC and cuBLAS for profiling kiln's host path with `perf` on a
// machine with no GPU (the GPU machines have no perf). Device memory is host memory, kernels
// and products do nothing, events are always complete, NVRTC "compiles" to a dummy image.
// Only what kiln calls is here: cudarc resolves each symbol on first use, and a missing one
// panics with its name. Build and use it with bench/host_profile.sh; never for results.
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static uintptr_t next_handle = 0x1000;
static void* handle(void) { next_handle += 16; return (void*)next_handle; }
// With KILN_STUB_COUNT=1 in the environment, every stand-in call is counted by name and the
// counts are printed to stderr at exit: how many driver calls an op costs, compared between
// two builds (the GPU machines have no tracer).
#define MAX_NAMES 256
static const char* names[MAX_NAMES];
static unsigned long long counts[MAX_NAMES];
static void count(const char* f) {
  for (int i = 0; i < MAX_NAMES; ++i) {
    if (names[i] == f || names[i] == 0) { names[i] = f; __atomic_fetch_add(&counts[i], 1, __ATOMIC_RELAXED); return; }
  }
}
__attribute__((destructor)) static void print_counts(void) {
  const char* on = getenv("KILN_STUB_COUNT");
  if (!on || strcmp(on, "1") != 0) return;
  for (int i = 0; i < MAX_NAMES && names[i]; ++i) fprintf(stderr, "stub calls %-36s %llu\n", names[i], counts[i]);
}
#define OK do { count(__func__); return 0; } while (0)
CUresult cuInit(unsigned f) { OK; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; OK; }
CUresult cuDeviceGetCount(int* n) { *n = 1; OK; }
CUresult cuDeviceGet(int* d, int o) { *d = o; OK; }
CUresult cuDeviceGetName(char* s, int len, int d) { strncpy(s, "Fake GPU", len); OK; }
CUresult cuDeviceTotalMem_v2(size_t* b, int d) { *b = 80ull << 30; OK; }
CUresult cuDeviceGetUuid(void* u, int d) { memset(u, 0, 16); OK; }
CUresult cuDeviceGetUuid_v2(void* u, int d) { memset(u, 0, 16); OK; }
CUresult cuDeviceGetAttribute(int* v, int a, int d) {
  switch (a) {
    case 75: *v = 9; break; case 76: *v = 0; break; case 16: *v = 132; break;
    case 1: *v = 1024; break; case 2: case 3: *v = 1024; break; case 4: *v = 65535; break;
    case 5: case 6: *v = 65535; break; case 8: *v = 49152; break; case 97: *v = 232448; break;
    case 10: *v = 32; break; case 41: *v = 1; break; case 81: *v = 2048; break;
    case 39: *v = 2048; break; case 82: *v = 65536; break; case 12: *v = 65536; break;
    default: *v = 1;
  }
  OK;
}
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0x77; OK; }
CUresult cuDevicePrimaryCtxRelease(int d) { OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { OK; }
CUresult cuDevicePrimaryCtxSetFlags(int d, unsigned f) { OK; }
CUresult cuDevicePrimaryCtxSetFlags_v2(int d, unsigned f) { OK; }
CUresult cuDevicePrimaryCtxGetState(int d, unsigned* f, int* a) { *f = 0; *a = 1; OK; }
CUresult cuCtxSetCurrent(void* c) { OK; }
CUresult cuCtxGetCurrent(void** c) { *c = (void*)0x77; OK; }
CUresult cuCtxPushCurrent_v2(void* c) { OK; }
CUresult cuCtxPopCurrent_v2(void** c) { if (c) *c = (void*)0x77; OK; }
CUresult cuCtxSynchronize(void) { OK; }
CUresult cuCtxGetDevice(int* d) { *d = 0; OK; }
CUresult cuCtxSetLimit(int l, size_t v) { OK; }
CUresult cuCtxGetLimit(size_t* v, int l) { *v = 1024; OK; }
CUresult cuDeviceCanAccessPeer(int* c, int a, int b) { *c = 0; OK; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { *f = 79ull << 30; *t = 80ull << 30; OK; }
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) { void* q = 0; if (posix_memalign(&q, 256, n ? n : 1)) return 2; *p = (CUdeviceptr)q; OK; }
CUresult cuMemFree_v2(CUdeviceptr p) { free((void*)p); OK; }
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, void* s) { return cuMemAlloc_v2(p, n); }
CUresult cuMemFreeAsync(CUdeviceptr p, void* s) { return cuMemFree_v2(p); }
CUresult cuMemHostAlloc(void** p, size_t n, unsigned f) { if (posix_memalign(p, 4096, n ? n : 1)) return 2; OK; }
CUresult cuMemAllocHost_v2(void** p, size_t n) { return cuMemHostAlloc(p, n, 0); }
CUresult cuMemFreeHost(void* p) { free(p); OK; }
CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned f) { OK; }
CUresult cuMemHostUnregister(void* p) { OK; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned f) { *d = (CUdeviceptr)p; OK; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { memcpy((void*)d, s, n); OK; }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { memcpy(d, (void*)s, n); OK; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { memmove((void*)d, (void*)s, n); OK; }
/* STUB_NO_COPY=1: asynchronous host<->device copies do nothing (their memcpy into fresh
 * "device" pages would otherwise dominate a profile of a loader, a cost the GPU does not
 * have). */
static int no_copy(void) { static int v = -1; if (v < 0) v = getenv("STUB_NO_COPY") != 0; return v; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) { if (!no_copy()) memcpy((void*)d, s, n); OK; }
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* st) { if (!no_copy()) memcpy(d, (void*)s, n); OK; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) { memmove((void*)d, (void*)s, n); OK; }
CUresult cuMemcpyPeerAsync(CUdeviceptr d, void* dc, CUdeviceptr s, void* sc, size_t n, void* st) { memmove((void*)d, (void*)s, n); OK; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { memset((void*)d, v, n); OK; }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* s) { memset((void*)d, v, n); OK; }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, void* s) { unsigned* p = (unsigned*)d; for (size_t i = 0; i < n; i++) p[i] = v; OK; }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { return cuMemsetD32Async(d, v, n, 0); }
CUresult cuStreamCreate(void** s, unsigned f) { *s = handle(); OK; }
CUresult cuStreamCreateWithPriority(void** s, unsigned f, int p) { *s = handle(); OK; }
CUresult cuStreamDestroy_v2(void* s) { OK; }
CUresult cuStreamSynchronize(void* s) { OK; }
CUresult cuStreamQuery(void* s) { OK; }
CUresult cuStreamWaitEvent(void* s, void* e, unsigned f) { OK; }
CUresult cuStreamIsCapturing(void* s, int* st) { *st = 0; OK; }
CUresult cuStreamGetPriority(void* s, int* p) { *p = 0; OK; }
CUresult cuCtxGetStreamPriorityRange(int* l, int* g) { *l = 0; *g = -5; OK; }
CUresult cuEventCreate(void** e, unsigned f) { *e = handle(); OK; }
CUresult cuEventDestroy_v2(void* e) { OK; }
// An event records the host's clock (no work runs, so an event-timed loop reports the host
// time it took to issue it: what a host-bound step costs).
#define EVENT_SLOTS 4096
static double event_time[EVENT_SLOTS];
static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}
static double* event_slot(void* e) { return &event_time[((uintptr_t)e >> 4) % EVENT_SLOTS]; }
CUresult cuEventRecord(void* e, void* s) { *event_slot(e) = now_ms(); OK; }
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned f) { *event_slot(e) = now_ms(); OK; }
CUresult cuEventQuery(void* e) { OK; }
CUresult cuEventSynchronize(void* e) { OK; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) { *ms = (float)(*event_slot(b) - *event_slot(a)); OK; }
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { *ms = (float)(*event_slot(b) - *event_slot(a)); OK; }
CUresult cuModuleLoadData(void** m, const void* img) { *m = handle(); OK; }
CUresult cuModuleLoadDataEx(void** m, const void* img, unsigned n, void* o, void** v) { *m = handle(); OK; }
CUresult cuModuleUnload(void* m) { OK; }
CUresult cuModuleGetFunction(void** f, void* m, const char* name) { *f = handle(); OK; }
CUresult cuFuncSetAttribute(void* f, int a, int v) { OK; }
CUresult cuFuncGetAttribute(int* v, int a, void* f) { *v = a == 0 ? 1024 : 32; OK; }
CUresult cuFuncSetCacheConfig(void* f, int c) { OK; }
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, void* f, int b, size_t s) { *n = 4; OK; }
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sm, void* s, void** p, void** e) { OK; }
CUresult cuGetErrorString(int e, const char** s) { *s = "fake error"; OK; }
CUresult cuGetErrorName(int e, const char** s) { *s = "FAKE_ERROR"; OK; }
CUresult cuPointerGetAttribute(void* d, int a, CUdeviceptr p) { memset(d, 0, 8); OK; }
// NVRTC
int nvrtcVersion(int* a, int* b) { *a = 13; *b = 0; return 0; }
// With KILN_STUB_SOURCES=DIR, every source handed to NVRTC is written there (what a run
// compiles, to time with the real NVRTC elsewhere).
int nvrtcCreateProgram(void** p, const char* src, const char* name, int n, const char* const* h, const char* const* i) {
  static int seq = 0;
  const char* dir = getenv("KILN_STUB_SOURCES");
  if (dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%04d-%s", dir, __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED), name ? name : "src.cu");
    FILE* f = fopen(path, "w");
    if (f) { fputs(src, f); fclose(f); }
  }
  *p = handle();
  return 0;
}
int nvrtcDestroyProgram(void** p) { return 0; }
int nvrtcCompileProgram(void* p, int n, const char* const* o) { return 0; }
int nvrtcGetCUBINSize(void* p, size_t* n) { *n = 64; return 0; }
int nvrtcGetCUBIN(void* p, char* b) { memset(b, 7, 64); return 0; }
int nvrtcGetPTXSize(void* p, size_t* n) { *n = 64; return 0; }
int nvrtcGetPTX(void* p, char* b) { memset(b, 'x', 63); b[63] = 0; return 0; }
int nvrtcGetProgramLogSize(void* p, size_t* n) { *n = 1; return 0; }
int nvrtcGetProgramLog(void* p, char* b) { b[0] = 0; return 0; }
const char* nvrtcGetErrorString(int r) { return "fake nvrtc"; }
int nvrtcAddNameExpression(void* p, const char* n) { return 0; }
int nvrtcGetLoweredName(void* p, const char* n, const char** l) { *l = n; return 0; }
CUresult cuDeviceGetDefaultMemPool(void** p, int d) { *p = handle(); OK; }
CUresult cuDeviceGetMemPool(void** p, int d) { *p = handle(); OK; }
CUresult cuMemPoolSetAttribute(void* p, int a, void* v) { OK; }
CUresult cuMemPoolGetAttribute(void* p, int a, void* v) { memset(v, 0, 8); OK; }
CUresult cuMemPoolTrimTo(void* p, size_t n) { OK; }
CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, size_t n, void* pool, void* s) { return cuMemAlloc_v2(p, n); }
CUresult cuMemPoolCreate(void** p, void* props) { *p = handle(); OK; }
CUresult cuMemPoolDestroy(void* p) { OK; }
CUresult cuStreamGetCaptureInfo_v2(void* s, int* st, unsigned long long* id, void** g, void** d, size_t* n) { *st = 0; OK; }
CUresult cuStreamGetCaptureInfo_v3(void* s, int* st, unsigned long long* id, void** g, void** d, void** e, size_t* n) { *st = 0; OK; }
CUresult cuThreadExchangeStreamCaptureMode(int* m) { OK; }

// cuBLAS
static uintptr_t next_blas = 0x9000;
int cublasCreate_v2(void** h) { next_blas += 16; *h = (void*)next_blas; return 0; }
int cublasDestroy_v2(void* h) { return 0; }
int cublasSetMathMode(void* h, int m) { count(__func__); return 0; }
int cublasSetStream_v2(void* h, void* s) { count(__func__); return 0; }
int cublasSetWorkspace_v2(void* h, void* w, unsigned long n) { count(__func__); return 0; }
int cublasSgemm_v2() { count(__func__); return 0; }
int cublasDgemm_v2() { count(__func__); return 0; }
int cublasSgemmStridedBatched() { count(__func__); return 0; }
int cublasDgemmStridedBatched() { count(__func__); return 0; }
int cublasGemmEx() { count(__func__); return 0; }
int cublasGemmStridedBatchedEx() { count(__func__); return 0; }
int cublasGetVersion_v2(void* h, int* v) { *v = 130000; return 0; }
const char* cublasGetStatusString(int s) { return "fake"; }
