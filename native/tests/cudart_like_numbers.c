/*
 * cudart_like's scenarios that check numbers: saxpy through every launch path, every copy and
 * set path (included by cudart_like.c; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Numbers                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static uint64_t fnv1a(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

static int scenario_saxpy(int n) {
    size_t bytes = (size_t)n * sizeof(float);
    float *x = malloc(bytes), *y = malloc(bytes), *ref = malloc(bytes), *out = malloc(bytes);
    if (!x || !y || !ref || !out) return 1;
    for (int i = 0; i < n; i++) {
        x[i] = (float)(i % 97) * 0.25f - 3.0f;
        y[i] = (float)(i % 13) * 1.5f + 0.125f;
        ref[i] = y[i];
    }
    CUdeviceptr dx, dy;
    CHECK(p_cuMemAlloc(&dx, bytes));
    CHECK(p_cuMemAlloc(&dy, bytes));
    CHECK(p_cuMemcpyHtoD(dx, x, bytes));
    CHECK(p_cuMemcpyHtoD(dy, y, bytes));
    const float as[3] = {2.5f, -0.75f, 1.25f};
    float a;
    void *params[] = {&a, &dx, &dy, &n};
    unsigned int grid = (unsigned int)((n + 255) / 256);
    if (grid == 0) grid = 1;
    a = as[0];
    CHECK(p_cuLaunchKernel(g_k_saxpy, grid, 1, 1, 256, 1, 1, 0, work_stream(), params, NULL));
    a = as[1];
    struct CUlaunchConfig_st cfg = {grid, 1, 1, 256, 1, 1, 0, work_stream(), NULL, 0};
    CHECK(p_cuLaunchKernelEx(&cfg, g_k_saxpy, params, NULL));
    a = as[2];
    CHECK(p_cuLaunchCooperativeKernel(g_k_saxpy, grid, 1, 1, 256, 1, 1, 0, work_stream(), params));
    CHECK(p_cuStreamSynchronize(work_stream()));
    CHECK(p_cuMemcpyDtoH(out, dy, bytes));
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < n; i++) ref[i] = as[k] * x[i] + ref[i];
    int mismatches = 0;
    double max_err = 0, sum = 0;
    for (int i = 0; i < n; i++) {
        double e = fabs((double)out[i] - (double)ref[i]);
        if (e > max_err) max_err = e;
        if (memcmp(&out[i], &ref[i], sizeof(float)) != 0) mismatches++;
        sum += out[i];
    }
    emit("saxpy",
         ",\"n\":%d,\"ok\":%s,\"mismatches\":%d,\"max_err\":%.9g,\"sum\":%.9g,\"hash\":\"%016llx\"",
         n, mismatches == 0 ? "true" : "false", mismatches, max_err, sum,
         (unsigned long long)fnv1a(out, bytes));
    CHECK(p_cuMemFree(dx));
    CHECK(p_cuMemFree(dy));
    free(x);
    free(y);
    free(ref);
    free(out);
    return mismatches != 0;
}

static int all_bytes(const unsigned char *g, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (g[i] != v) return 0;
    return 1;
}

/* Every copy and set path, each checked against the host. */
static int scenario_copies(size_t n) {
    n &= ~(size_t)3;
    if (n < 64) n = 64;
    unsigned char *h = malloc(n), *g = malloc(n);
    if (!h || !g) return 1;
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 13 + 5);
    CUdeviceptr a, b;
    CHECK(p_cuMemAlloc(&a, n));
    CHECK(p_cuMemAlloc(&b, n));
    int all_ok = 1;
#define STEP(name, call, check)                                                                  \
    do {                                                                                         \
        CUresult rc_ = (call);                                                                   \
        if (rc_ == CUDA_SUCCESS) rc_ = p_cuStreamSynchronize(g_stream);                          \
        int ok_ = rc_ == CUDA_SUCCESS && (check);                                                \
        all_ok &= ok_;                                                                           \
        emit("copy", ",\"path\":\"%s\",\"rc\":%d,\"ok\":%s", name, rc_, ok_ ? "true" : "false"); \
    } while (0)
#define READ_B() (p_cuMemcpyDtoH(g, b, n) == CUDA_SUCCESS)
#define SAME_AS_H() (memcmp(g, h, n) == 0)
    STEP("cuMemcpyHtoD", p_cuMemcpyHtoD(a, h, n), 1);
    STEP("cuMemcpyDtoD", p_cuMemcpyDtoD(b, a, n), READ_B() && SAME_AS_H());
    memset(g, 0, n);
    STEP("cuMemcpyDtoH", p_cuMemcpyDtoH(g, a, n), SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpy", p_cuMemcpy(b, a, n), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyAsync", p_cuMemcpyAsync(b, a, n, g_stream), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyDtoDAsync", p_cuMemcpyDtoDAsync(b, a, n, g_stream), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyHtoDAsync", p_cuMemcpyHtoDAsync(b, h, n, g_stream), READ_B() && SAME_AS_H());
    memset(g, 0, n);
    STEP("cuMemcpyDtoHAsync", p_cuMemcpyDtoHAsync(g, a, n, g_stream), SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyPeer", p_cuMemcpyPeer(b, g_ctx, a, g_ctx, n), READ_B() && SAME_AS_H());
    p_cuMemsetD8(b, 0, n);
    STEP("cuMemcpyPeerAsync", p_cuMemcpyPeerAsync(b, g_ctx, a, g_ctx, n, g_stream),
         READ_B() && SAME_AS_H());
#define ALL_BYTES(v) all_bytes(g, n, v)
    STEP("cuMemsetD8", p_cuMemsetD8(b, 0x5a, n), READ_B() && ALL_BYTES(0x5a));
    STEP("cuMemsetD8Async", p_cuMemsetD8Async(b, 0x3c, n, g_stream), READ_B() && ALL_BYTES(0x3c));
    STEP("cuMemsetD16", p_cuMemsetD16(b, 0x7171, n / 2), READ_B() && ALL_BYTES(0x71));
    STEP("cuMemsetD16Async", p_cuMemsetD16Async(b, 0x2929, n / 2, g_stream),
         READ_B() && ALL_BYTES(0x29));
    STEP("cuMemsetD32", p_cuMemsetD32(b, 0x66666666u, n / 4), READ_B() && ALL_BYTES(0x66));
    STEP("cuMemsetD32Async", p_cuMemsetD32Async(b, 0x11111111u, n / 4, g_stream),
         READ_B() && ALL_BYTES(0x11));
#undef STEP
    emit("copies", ",\"ok\":%s", all_ok ? "true" : "false");
    p_cuMemFree(a);
    p_cuMemFree(b);
    free(h);
    free(g);
    return !all_ok;
}
