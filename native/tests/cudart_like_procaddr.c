/*
 * cudart_like's procaddr scenario: cuGetProcAddress obtained through cuGetProcAddress_v2 and
 * used as v1 (included by cudart_like.c; not compiled alone).
 */

/* ------------------------------------------------------------------------------------------ */
/* cuGetProcAddress obtained through cuGetProcAddress_v2, used as v1                           */
/* ------------------------------------------------------------------------------------------ */

typedef CUresult fn_getproc_v1_poisoned(const char *, void **, int, cuuint64_t, void *);

static int saxpy_with(fn_getproc_v1 *gpa, int version, const char *label) {
    void *alloc = NULL, *launch = NULL, *htod = NULL, *dtoh = NULL, *mfree = NULL;
    CUresult rc = gpa("cuMemAlloc", &alloc, version, 0);
    rc = rc ? rc : gpa("cuLaunchKernel", &launch, version, 0);
    rc = rc ? rc : gpa("cuMemcpyHtoD", &htod, version, 0);
    rc = rc ? rc : gpa("cuMemcpyDtoH", &dtoh, version, 0);
    rc = rc ? rc : gpa("cuMemFree", &mfree, version, 0);
    if (rc) return fail(label, rc);
    char w[512];
    where(alloc, w, sizeof(w));
    int n = 1000;
    size_t bytes = (size_t)n * sizeof(float);
    float x[1000], y[1000], out[1000];
    for (int i = 0; i < n; i++) {
        x[i] = (float)i * 0.5f;
        y[i] = 1.0f;
    }
    CUdeviceptr dx, dy;
    CHECK(((fn_cuMemAlloc *)alloc)(&dx, bytes));
    CHECK(((fn_cuMemAlloc *)alloc)(&dy, bytes));
    CHECK(((fn_cuMemcpyHtoD *)htod)(dx, x, bytes));
    CHECK(((fn_cuMemcpyHtoD *)htod)(dy, y, bytes));
    float a = 3.0f;
    void *params[] = {&a, &dx, &dy, &n};
    CHECK(((fn_cuLaunchKernel *)launch)(g_k_saxpy, 4, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    CHECK(((fn_cuMemcpyDtoH *)dtoh)(out, dy, bytes));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += out[i] != 3.0f * x[i] + 1.0f;
    ((fn_cuMemFree *)mfree)(dx);
    ((fn_cuMemFree *)mfree)(dy);
    emit("procaddr_use", ",\"via\":\"%s\",\"ok\":%s,\"mismatches\":%d,\"cuMemAlloc\":%s", label,
         bad ? "false" : "true", bad, w);
    return bad != 0;
}

static int scenario_procaddr(void) {
    char w1[512], w2[512];
    /* cudart asks for "cuGetProcAddress" itself; below 12000 the answer has the v1 ABI. */
    void *v1 = NULL, *v2 = NULL;
    CUdriverProcAddressQueryResult s1 = -1, s2 = -1;
    CUresult r1 = g_gpa2("cuGetProcAddress", &v1, 11080, 0, &s1);
    CUresult r2 = g_gpa2("cuGetProcAddress", &v2, 12000, 0, &s2);
    where(v1, w1, sizeof(w1));
    where(v2, w2, sizeof(w2));
    emit("procaddr", ",\"v1\":{\"rc\":%d,\"status\":%d,\"where\":%s},\"v2\":{\"rc\":%d,\"status\":%d,"
         "\"where\":%s},\"distinct\":%s",
         r1, (int)s1, w1, r2, (int)s2, w2, v1 != v2 ? "true" : "false");
    if (r1 || r2 || !v1 || !v2) return 1;
    int bad = 0;
    bad |= saxpy_with((fn_getproc_v1 *)v1, 12080, "v1");
    /* A v1 caller leaves garbage where a 5th argument would be: make it a pointer that cannot be
     * written. A correct v1 wrapper never looks at it; a v2-shaped one crashes here. */
    void *alloc = NULL;
    CUresult rp = ((fn_getproc_v1_poisoned *)v1)("cuMemAlloc", &alloc, 12080, 0, (void *)(uintptr_t)1);
    where(alloc, w1, sizeof(w1));
    emit("procaddr_poisoned", ",\"rc\":%d,\"where\":%s", rp, w1);
    bad |= rp != CUDA_SUCCESS;
    /* And the v2 ABI obtained the same way. */
    void *p = NULL;
    CUdriverProcAddressQueryResult st = -1;
    CUresult r = ((fn_getproc_v2 *)v2)("cuMemAlloc", &p, 12080, 0, &st);
    where(p, w2, sizeof(w2));
    emit("procaddr_v2_call", ",\"rc\":%d,\"status\":%d,\"where\":%s", r, (int)st, w2);
    bad |= r != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS;
    /* Unknown names: CUDA_ERROR_NOT_FOUND, symbol not found, NULL. */
    p = (void *)&bad;
    st = -1;
    r = ((fn_getproc_v2 *)v2)("cuNoSuchFunction", &p, 12080, 0, &st);
    emit("procaddr_unknown", ",\"rc\":%d,\"status\":%d,\"null\":%s", r, (int)st,
         p == NULL ? "true" : "false");
    return bad;
}
