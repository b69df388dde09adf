// Utility kernels that are not tensor ops.

// Keeps one thread busy for `ns` nanoseconds of the GPU's global timer: a kernel of known
// length that occupies almost nothing, for tests and benchmarks of stream concurrency and
// ordering (CUDA samples' `clock_block`).
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
