//! GPU model and driver, read from the libcuda the host already loaded
//! (RTLD_NOLOAD: we never load the driver ourselves, and only ask once CUDA
//! is initialised: `cuDeviceGetCount` fails before).

use hopscope_gpu_wire::Device;
use std::ffi::{c_char, c_int, CStr};

// cuda.h: CUdevice_attribute values (stable since CUDA 2.x / 3.x).
const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

type IntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type DeviceName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type DeviceAttr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type DeviceMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;

/// The devices, or None when libcuda is not loaded or not initialised yet.
pub fn probe() -> Option<Vec<Device>> {
    // SAFETY: RTLD_NOLOAD takes a reference to an already initialised
    // library, or fails; nothing new is loaded.
    let lib = unsafe { cupti_sys::libloading::os::unix::Library::open(Some("libcuda.so.1"), libc::RTLD_NOW | libc::RTLD_NOLOAD) }.ok()?;
    // SAFETY: the symbols are typed with cuda.h's signatures (CUdevice is an
    // int, CUresult an enum returned as int); each call below writes only
    // through pointers to our own locals, with the buffer length we pass.
    unsafe {
        let version: IntOut = *lib.get::<IntOut>(b"cuDriverGetVersion\0").ok()?;
        let count: IntOut = *lib.get::<IntOut>(b"cuDeviceGetCount\0").ok()?;
        let get: DeviceGet = *lib.get::<DeviceGet>(b"cuDeviceGet\0").ok()?;
        let name: DeviceName = *lib.get::<DeviceName>(b"cuDeviceGetName\0").ok()?;
        let attr: DeviceAttr = *lib.get::<DeviceAttr>(b"cuDeviceGetAttribute\0").ok()?;
        let mem: DeviceMem = *lib.get::<DeviceMem>(b"cuDeviceTotalMem_v2\0").ok()?;
        let mut n: c_int = 0;
        if count(&mut n) != 0 || n <= 0 {
            return None;
        }
        let mut driver: c_int = 0;
        let _ = version(&mut driver);
        let mut out = Vec::new();
        for ordinal in 0..n.min(64) {
            let mut dev: c_int = 0;
            if get(&mut dev, ordinal) != 0 {
                continue;
            }
            let mut buf = [0 as c_char; 256];
            let model = if name(buf.as_mut_ptr(), buf.len() as c_int - 1, dev) == 0 {
                CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
            } else {
                String::new()
            };
            let a = |which: c_int| {
                let mut v: c_int = 0;
                if attr(&mut v, which, dev) == 0 {
                    v.max(0) as u32
                } else {
                    0
                }
            };
            let mut bytes = 0usize;
            let _ = mem(&mut bytes, dev);
            out.push(Device {
                ordinal: ordinal as u32,
                cc_major: a(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                cc_minor: a(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                sm_count: a(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                total_mem_bytes: bytes as u64,
                driver_version: driver.max(0) as u32,
                name: model,
            });
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_loaded_driver_there_is_nothing_to_report() {
        if std::path::Path::new("/dev/nvidia0").exists() {
            return; // a GPU machine may have libcuda loaded by something else
        }
        assert_eq!(super::probe(), None);
    }
}
