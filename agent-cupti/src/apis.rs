//! The CUDA API calls we ask CUPTI to record (per-API filters,
//! `cuptiActivityEnableRuntimeApi` / `cuptiActivityEnableDriverApi`, CUPTI
//! 12.5+): launches, graph launches, copies, memsets and host syncs. These
//! link GPU records to CPU time via correlation ids; everything else stays
//! off (recording every API call is where profilers lose throughput).
//! Callback ids are stable across 12.4…13.4 (checked against each wheel's
//! cupti_*_cbid.h); ids a given libcupti does not know are refused by it and
//! skipped.

use cupti_sys::*;
use hopscope_gpu_wire::ApiClass;

pub struct TracedApi {
    pub driver: bool,
    pub class: ApiClass,
    pub cbid: u32,
    pub name: &'static str,
}

macro_rules! apis {
    ($($dom:ident $class:ident $($id:ident)+;)+) => {
        &[$($(TracedApi {
            driver: apis!(@dom $dom),
            class: ApiClass::$class,
            cbid: $id,
            name: apis!(@name $dom $id),
        },)+)+]
    };
    (@dom runtime) => { false };
    (@dom driver) => { true };
    (@name runtime $id:ident) => { strip(stringify!($id), "CUPTI_RUNTIME_TRACE_CBID_") };
    (@name driver $id:ident) => { strip(stringify!($id), "CUPTI_DRIVER_TRACE_CBID_") };
}

const fn strip(s: &'static str, prefix: &'static str) -> &'static str {
    let (_, rest) = s.as_bytes().split_at(prefix.len());
    match std::str::from_utf8(rest) {
        Ok(r) => r,
        Err(_) => s,
    }
}

pub const TRACED: &[TracedApi] = apis! {
    runtime KernelLaunch CUPTI_RUNTIME_TRACE_CBID_cudaLaunch_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaLaunch_ptsz_v7000
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000 CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060 CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000 CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernelMultiDevice_v9000
        CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000 CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000;
    runtime GraphLaunch CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000 CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000;
    runtime Memcpy CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_ptds_v7000 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_ptds_v7000 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_ptsz_v7000
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeer_v4000 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeerAsync_v4000
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyBatchAsync_v12080 CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyBatchAsync_v13000;
    runtime Memset CUPTI_RUNTIME_TRACE_CBID_cudaMemset_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset_ptds_v7000 CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_ptsz_v7000
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_v3020;
    runtime Sync CUPTI_RUNTIME_TRACE_CBID_cudaDeviceSynchronize_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaThreadSynchronize_v3020
        CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_v3020 CUPTI_RUNTIME_TRACE_CBID_cudaStreamSynchronize_ptsz_v7000
        CUPTI_RUNTIME_TRACE_CBID_cudaEventSynchronize_v3020;
    driver KernelLaunch CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz
        CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz;
    driver GraphLaunch CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz;
    driver Memcpy CUPTI_DRIVER_TRACE_CBID_cuMemcpy CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync
        CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz
        CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2 CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2 CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2
        CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2 CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2 CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2
        CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2_ptds
        CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz
        CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeer CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeerAsync
        CUPTI_DRIVER_TRACE_CBID_cuMemcpy2D_v2 CUPTI_DRIVER_TRACE_CBID_cuMemcpy2DAsync_v2
        CUPTI_DRIVER_TRACE_CBID_cuMemcpy3D_v2 CUPTI_DRIVER_TRACE_CBID_cuMemcpy3DAsync_v2
        CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2;
    driver Memset CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2 CUPTI_DRIVER_TRACE_CBID_cuMemsetD16_v2 CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2
        CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async
        CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2_ptds CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2_ptds
        CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz;
    driver Sync CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2
        CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz
        CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize;
};

/// The traced API with this domain and callback id.
pub fn lookup(driver: bool, cbid: u32) -> Option<&'static TracedApi> {
    TRACED.iter().find(|a| a.driver == driver && a.cbid == cbid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traced_set_covers_launches_graphs_copies_and_syncs_without_duplicates() {
        let l = lookup(false, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000).unwrap();
        assert_eq!((l.name, l.class), ("cudaLaunchKernel_v7000", ApiClass::KernelLaunch));
        assert_eq!(lookup(true, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch).unwrap().name, "cuGraphLaunch");
        assert_eq!(lookup(true, CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize).unwrap().class, ApiClass::Sync);
        assert!(lookup(false, CUPTI_RUNTIME_TRACE_CBID_cudaMalloc_v3020).is_none(), "allocations are not traced");
        for (i, a) in TRACED.iter().enumerate() {
            assert!(TRACED[..i].iter().all(|b| (b.driver, b.cbid) != (a.driver, a.cbid)), "{} twice", a.name);
            assert!(a.name.starts_with("cu") || a.name.starts_with("__cuda"), "{}", a.name);
        }
    }
}
