/*
 * cudart_like's paths scenario: every gated entry point once, with the status API's and the
 * stand-in's counts before and after (included by cudart_like.c; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* Every gated entry point once                                                                 */
/* ------------------------------------------------------------------------------------------ */

static int scenario_paths(void) {
    size_t n = 4096;
    CUdeviceptr a, b, m;
    unsigned char *h = calloc(1, n);
    CHECK(p_cuMemAlloc(&a, n));
    CHECK(p_cuMemAlloc(&b, n));
    CHECK(p_cuMemAllocManaged(&m, n, CU_MEM_ATTACH_GLOBAL));
    CUstream s = work_stream();
    void *noargs[] = {NULL};
    struct CUlaunchConfig_st cfg = {1, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    CUmemLocation host = {CU_MEM_LOCATION_TYPE_HOST, 0};
    int all_ok = 1;
#define PATH(base, sym, ptsym, call)                                                             \
    do {                                                                                         \
        long g0_ = gated_calls(), c0_ = fake_count(#sym), t0_ = fake_count(#ptsym);              \
        CUresult rc_ = (call);                                                                   \
        long g1_ = gated_calls(), c1_ = fake_count(#sym), t1_ = fake_count(#ptsym);              \
        all_ok &= rc_ == CUDA_SUCCESS;                                                           \
        emit("path",                                                                             \
             ",\"path\":\"%s\",\"rc\":%d,\"gated_delta\":%ld,\"fake\":{\"%s\":%ld,\"%s\":%ld}",  \
             #base, rc_, g0_ < 0 ? -1 : g1_ - g0_, #sym, c1_ - c0_, #ptsym, t1_ - t0_);          \
    } while (0)
    PATH(cuLaunchKernel, cuLaunchKernel, cuLaunchKernel_ptsz,
         p_cuLaunchKernel(g_k_noop, 1, 1, 1, 1, 1, 1, 0, s, noargs, NULL));
    PATH(cuLaunchKernelEx, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,
         p_cuLaunchKernelEx(&cfg, g_k_noop, noargs, NULL));
    PATH(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz,
         p_cuLaunchCooperativeKernel(g_k_noop, 1, 1, 1, 1, 1, 1, 0, s, noargs));
    PATH(cuGraphLaunch, cuGraphLaunch, cuGraphLaunch_ptsz, p_cuGraphLaunch(GRAPH, s));
    PATH(cuMemcpy, cuMemcpy, cuMemcpy_ptds, p_cuMemcpy(b, a, n));
    PATH(cuMemcpyAsync, cuMemcpyAsync, cuMemcpyAsync_ptsz, p_cuMemcpyAsync(b, a, n, s));
    PATH(cuMemcpyHtoD, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, p_cuMemcpyHtoD(a, h, n));
    PATH(cuMemcpyDtoH, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, p_cuMemcpyDtoH(h, a, n));
    PATH(cuMemcpyDtoD, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, p_cuMemcpyDtoD(b, a, n));
    PATH(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz,
         p_cuMemcpyHtoDAsync(a, h, n, s));
    PATH(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz,
         p_cuMemcpyDtoHAsync(h, a, n, s));
    PATH(cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz,
         p_cuMemcpyDtoDAsync(b, a, n, s));
    PATH(cuMemcpyPeer, cuMemcpyPeer, cuMemcpyPeer_ptds, p_cuMemcpyPeer(b, g_ctx, a, g_ctx, n));
    PATH(cuMemcpyPeerAsync, cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz,
         p_cuMemcpyPeerAsync(b, g_ctx, a, g_ctx, n, s));
    PATH(cuMemsetD8, cuMemsetD8_v2, cuMemsetD8_v2_ptds, p_cuMemsetD8(a, 1, n));
    PATH(cuMemsetD16, cuMemsetD16_v2, cuMemsetD16_v2_ptds, p_cuMemsetD16(a, 1, n / 2));
    PATH(cuMemsetD32, cuMemsetD32_v2, cuMemsetD32_v2_ptds, p_cuMemsetD32(a, 1, n / 4));
    PATH(cuMemsetD8Async, cuMemsetD8Async, cuMemsetD8Async_ptsz, p_cuMemsetD8Async(a, 1, n, s));
    PATH(cuMemsetD16Async, cuMemsetD16Async, cuMemsetD16Async_ptsz,
         p_cuMemsetD16Async(a, 1, n / 2, s));
    PATH(cuMemsetD32Async, cuMemsetD32Async, cuMemsetD32Async_ptsz,
         p_cuMemsetD32Async(a, 1, n / 4, s));
    if (prefetch_is_v2())
        PATH(cuMemPrefetchAsync, cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz,
             p_cuMemPrefetchAsync(m, n, host, 0, s));
    else
        PATH(cuMemPrefetchAsync, cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz,
             ((fn_prefetch_v1 *)(void *)p_cuMemPrefetchAsync)(m, n, CU_DEVICE_CPU, s));
#undef PATH
    CHECK(p_cuStreamSynchronize(s));
    emit("paths", ",\"ok\":%s", all_ok ? "true" : "false");
    p_cuMemFree(a);
    p_cuMemFree(b);
    p_cuMemFree(m);
    free(h);
    return !all_ok;
}
