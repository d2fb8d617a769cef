/*
 * The CUDA 12 runtime under the shim. The GPU machine's frameworks are all built for CUDA 13;
 * this program links the CUDA 12.9 runtime (libcudart.so.12 from the nvidia-cuda-runtime-cu12
 * wheel) so the shim is also verified against the way a CUDA 12 runtime resolves the driver.
 *
 * It fills a buffer with a PTX kernel (loaded with cudaLibraryLoadData: no nvcc needed), copies it
 * back, checks every element, exercises the stream-ordered allocator and the memory view, and
 * prints one JSON line (with the shim's status when it runs under the shim).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "gpushare.h"

/* The part of the CUDA runtime API used here, declared by hand as in cuda_runtime_api.h of 12.9
 * (the runtime's headers need the toolkit's crt/ headers, which the runtime wheel lacks). */
typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUlib_st *cudaLibrary_t;
typedef struct CUkern_st *cudaKernel_t;
typedef struct {
    unsigned int x, y, z;
} dim3;
enum { cudaSuccess = 0, cudaMemcpyDeviceToHost = 2 };
cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
cudaError_t cudaDriverGetVersion(int *driverVersion);
cudaError_t cudaLibraryLoadData(cudaLibrary_t *library, const void *code, int *jitOptions,
                                void **jitOptionsValues, unsigned int numJitOptions,
                                int *libraryOptions, void **libraryOptionValues,
                                unsigned int numLibraryOptions);
cudaError_t cudaLibraryGetKernel(cudaKernel_t *pKernel, cudaLibrary_t library, const char *name);
cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaMemset(void *devPtr, int value, size_t count);
cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                             size_t sharedMem, cudaStream_t stream);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind);
cudaError_t cudaStreamCreate(cudaStream_t *pStream);
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream);
cudaError_t cudaFree(void *devPtr);
const char *cudaGetErrorString(cudaError_t error);

static const char PTX[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry fill(.param .u64 p, .param .f32 v, .param .u32 n)\n{\n"
    "  .reg .pred %p<2>;\n  .reg .b32 %r<6>;\n  .reg .f32 %f<2>;\n  .reg .b64 %rd<5>;\n"
    "  ld.param.u64 %rd1, [p];\n  ld.param.f32 %f1, [v];\n  ld.param.u32 %r2, [n];\n"
    "  mov.u32 %r3, %ctaid.x;\n  mov.u32 %r4, %ntid.x;\n  mov.u32 %r5, %tid.x;\n"
    "  mad.lo.s32 %r1, %r3, %r4, %r5;\n  setp.ge.u32 %p1, %r1, %r2;\n  @%p1 bra DONE;\n"
    "  cvta.to.global.u64 %rd2, %rd1;\n  mul.wide.u32 %rd3, %r1, 4;\n"
    "  add.s64 %rd4, %rd2, %rd3;\n  st.global.f32 [%rd4], %f1;\nDONE:\n  ret;\n}\n";

#define CHECK(call)                                                                               \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            printf("{\"error\": \"%s: %s\"}\n", #call, cudaGetErrorString(e_));                  \
            return 1;                                                                             \
        }                                                                                         \
    } while (0)

int main(void)
{
    int runtime = 0, driver = 0;
    CHECK(cudaRuntimeGetVersion(&runtime));
    CHECK(cudaDriverGetVersion(&driver));

    cudaLibrary_t lib;
    cudaKernel_t kernel;
    CHECK(cudaLibraryLoadData(&lib, PTX, NULL, NULL, 0, NULL, NULL, 0));
    CHECK(cudaLibraryGetKernel(&kernel, lib, "fill"));

    unsigned int n = 1u << 24; /* 64 MiB of floats */
    float *d = NULL, value = 3.5f;
    CHECK(cudaMalloc((void **)&d, n * sizeof(float)));
    CHECK(cudaMemset(d, 0, n * sizeof(float)));
    void *args[] = {&d, &value, &n};
    dim3 block = {256, 1, 1}, grid = {(n + 255) / 256, 1, 1};
    CHECK(cudaLaunchKernel((const void *)kernel, grid, block, args, 0, NULL));
    float *h = malloc(n * sizeof(float));
    if (!h)
        return 1;
    CHECK(cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    unsigned int wrong = 0;
    for (unsigned int i = 0; i < n; i++)
        wrong += h[i] != value;

    cudaStream_t s;
    void *pooled = NULL;
    CHECK(cudaStreamCreate(&s));
    CHECK(cudaMallocAsync(&pooled, 32u << 20, s));
    CHECK(cudaMemsetAsync(pooled, 1, 32u << 20, s));
    size_t free_b = 0, total_b = 0;
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemGetInfo(&free_b, &total_b));
    CHECK(cudaFreeAsync(pooled, s));
    CHECK(cudaStreamSynchronize(s));

    struct gpushare_status st;
    int (*get_status)(struct gpushare_status *, size_t) =
        (int (*)(struct gpushare_status *, size_t))dlsym(RTLD_DEFAULT, "gpushare_get_status");
    int shim = get_status && get_status(&st, sizeof st) == 0;
    printf("{\"runtime\": %d, \"driver\": %d, \"elements\": %u, \"wrong\": %u, "
           "\"mem_free\": %zu, \"mem_total\": %zu, \"shim\": %d",
           runtime, driver, n, wrong, free_b, total_b, shim);
    if (shim)
        printf(", \"gated_calls\": %llu, \"managed_bytes\": %llu, \"used_bytes\": %llu, "
               "\"connected\": %u",
               (unsigned long long)st.gated_calls, (unsigned long long)st.managed_bytes,
               (unsigned long long)st.used_bytes, st.connected);
    printf("}\n");
    CHECK(cudaFree(d));
    free(h);
    return wrong != 0;
}
