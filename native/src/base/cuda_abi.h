/*
 * The small part of the CUDA driver ABI that libgpushare uses, declared by hand so the shim builds
 * with a plain C compiler and no CUDA toolkit. Every value here is the driver's ABI (cuda.h of
 * CUDA 12.x/13.x); the test stand-in driver (native/tests/fake_libcuda.c) includes this same file.
 *
 * Only types and constants live here. Function signatures are in hooks.def (the hooked ones) and
 * next to their single use (the few the shim calls but does not hook).
 */
#ifndef GPUSHARE_CUDA_ABI_H
#define GPUSHARE_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2: 64-bit on every 64-bit platform */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUkern_st *CUkernel;
typedef unsigned int cuuint32_t;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;
typedef union CUstreamBatchMemOpParams_union CUstreamBatchMemOpParams;
typedef struct CUDA_LAUNCH_PARAMS_st CUDA_LAUNCH_PARAMS;

/* Stream capture (cuda.h CUstreamCaptureMode / CUstreamCaptureStatus). */
enum {
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2
};
enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_STREAM_CAPTURE_STATUS_ACTIVE = 1 };
typedef int CUstreamCaptureMode;
typedef int CUstreamCaptureStatus;

/* CUresult values the shim produces or inspects. */
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_UNKNOWN = 999
};

/* cuMemAllocManaged flags */
enum { CU_MEM_ATTACH_GLOBAL = 0x1, CU_MEM_ATTACH_HOST = 0x2 };

/* cuGetProcAddress flags */
enum {
    CU_GET_PROC_ADDRESS_DEFAULT = 0,
    CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1,
    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2
};

/* cuGetProcAddress_v2 symbolStatus */
typedef enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

/* The CPU as a prefetch destination for the v1 cuMemPrefetchAsync. */
#define CU_DEVICE_CPU ((CUdevice)-1)

/* CUmemLocation, for cuMemPrefetchAsync_v2 (CUDA >= 12.2). */
typedef enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_LOCATION_TYPE_HOST = 2
} CUmemLocationType;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation;

/* cuLaunchKernelEx's configuration (cuda.h 12.x/13.x layout). The shim reads only hStream, to know
 * which stream a launch went to; the stand-in driver and the test program fill the whole struct. */
typedef struct CUlaunchAttribute_st {
    int id;       /* CUlaunchAttributeID */
    char pad[4];  /* 8 - sizeof(CUlaunchAttributeID) */
    char value[64]; /* CUlaunchAttributeValue: a 64-byte union */
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX;
    unsigned int gridDimY;
    unsigned int gridDimZ;
    unsigned int blockDimX;
    unsigned int blockDimY;
    unsigned int blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* Only passed through by the shim: opaque to it. */
typedef struct CUmemAllocationProp_st CUmemAllocationProp;
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;
typedef struct CUDA_MEMCPY3D_BATCH_OP_st CUDA_MEMCPY3D_BATCH_OP;
typedef struct CUmemcpyAttributes_st CUmemcpyAttributes;
typedef struct CUctxCreateParams_st CUctxCreateParams;

/* cuArrayCreate / cuArray3DCreate / cuMipmappedArrayCreate descriptors (the shim counts the bytes
 * they describe). Format is a CUarray_format. */
typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

/* Stream-ordered pools and graph memory (cuda.h 12.x/13.x layouts): the shim counts what a pool
 * keeps reserved (memory/reserves.c) and reads the sizes of a graph's mem-alloc nodes. */
enum {
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8
};
typedef int CUmemPool_attribute;
enum {
    CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0,
    CU_GRAPH_MEM_ATTR_USED_MEM_HIGH = 1,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT = 2,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH = 3
};
typedef int CUgraphMem_attribute;
enum { CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10, CU_GRAPH_NODE_TYPE_MEM_FREE = 11 };
typedef int CUgraphNodeType;

typedef struct CUmemPoolProps_st {
    int allocType;   /* CUmemAllocationType */
    int handleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_st {
    CUmemPoolProps poolProps;
    const void *accessDescs; /* const CUmemAccessDesc * */
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr; /* out */
} CUDA_MEM_ALLOC_NODE_PARAMS;

/* CUgraphInstantiate_flags: a relaunch frees what the previous launch allocated (PyTorch). */
enum { GS_GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH = 1 };
/* cuGraphInstantiateWithParams' parameters: passed through (the shim reads the leading flags). */
typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st CUDA_GRAPH_INSTANTIATE_PARAMS;

/* cuIpcGetMemHandle's handle: 64 opaque bytes. */
typedef struct CUipcMemHandle_st {
    char reserved[64];
} CUipcMemHandle;

/* CUuuid */
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

/* The NVML structures the shim rewrites inside the process. */
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0 };

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#endif /* GPUSHARE_CUDA_ABI_H */
