//! The real scrubber: CUDA through cudarc's driver API, meant to run in a child process
//! (`tessera scrub --device UUID`) so no CUDA state ever lives in the daemon.
//!
//! The caller picks the device by setting `CUDA_VISIBLE_DEVICES=<uuid>` before the first
//! driver call (MIG instances can only be picked that way); the scrubber then works on
//! ordinal 0 and checks its uuid against the one asked for.
//!
//! A scrub: `cuMemGetInfo`; allocate the free memory less a small reserve in chunks of up
//! to 1 GiB, halving a chunk on out-of-memory down to 2 MiB; `cuMemsetD32Async` zero
//! into every chunk on one stream; launch the embedded verify kernel
//! ([`crate::ptx`]) over every chunk, counting non-zero words into one device counter;
//! synchronise, read the counter, free. The zero and verify passes are timed with events.
//!
//! Without `libcuda` every cudarc driver call panics, so [`driver_present`] is checked
//! before any of them ([`ScrubError::NoDriver`]), and every driver session runs under
//! `catch_unwind` in case an old driver lacks a symbol.

use std::ffi::{c_void, CString};
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::time::Instant;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use serde::Serialize;

use crate::error::ScrubError;
use crate::ptx;
use crate::report::{gbps, ScrubReport, BACKEND_CUDA};
use crate::Scrubber;

const MIB: u64 = 1 << 20;
/// Allocation granularity: large `cuMemAlloc`s are backed by 2 MiB pages.
const GRANULE: u64 = 2 * MIB;

/// Tuning of the CUDA scrubber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Free memory left unallocated for the driver's own needs during the scrub.
    pub reserve_bytes: u64,
    /// Largest single allocation.
    pub max_chunk: u64,
    /// Smallest allocation tried before giving up on the rest.
    pub min_chunk: u64,
    /// Threads per block of the verify kernel.
    pub block_threads: u32,
    /// Blocks per SM of the verify kernel (its grid-stride loop covers the rest).
    pub blocks_per_sm: u32,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            reserve_bytes: 32 * MIB,
            max_chunk: 1 << 30,
            min_chunk: GRANULE,
            block_threads: 256,
            blocks_per_sm: 8,
        }
    }
}

/// Whether `libcuda` can be loaded. Check this before any other cudarc driver call.
pub fn driver_present() -> bool {
    // SAFETY: is_culib_present only tries to dlopen the candidate library names and
    // drops any handle it got; it touches no other state.
    unsafe { sys::is_culib_present() }
}

/// The CUDA scrubber. Holds no CUDA state: every operation opens the device, works, and
/// releases everything before returning.
#[derive(Debug, Clone)]
pub struct CudaScrubber {
    opts: CudaOptions,
}

/// `gpu-bench peak`: plain `cuMemsetD32` against the scrub passes on the same buffer.
#[derive(Debug, Clone, Serialize)]
pub struct PeakReport {
    pub device_name: String,
    pub device_uuid: String,
    pub bytes: u64,
    pub chunks: u32,
    pub reps: u32,
    /// Best `cuMemsetD32Async` over the whole buffer, timed with events.
    pub memset_async_gbps: f64,
    /// Best synchronous `cuMemsetD32` over the whole buffer, wall-timed.
    pub memset_sync_gbps: f64,
    /// The higher of the two: the peak the scrub is held against.
    pub memset_peak_gbps: f64,
    /// Best zero pass of the scrub.
    pub scrub_zero_gbps: f64,
    /// Best verify pass of the scrub.
    pub scrub_verify_gbps: f64,
    /// Best (zeroed + verified bytes) / (zero + verify time): the scrub's bandwidth.
    pub scrub_gbps: f64,
    /// Best bytes scrubbed per second (each byte written and read back once).
    pub scrub_clean_gbps: f64,
    /// scrub_gbps / memset_peak_gbps: the acceptance figure (target >= 0.8).
    pub ratio: f64,
    /// scrub_zero_gbps / memset_peak_gbps.
    pub zero_ratio: f64,
    /// scrub_clean_gbps / memset_peak_gbps (at most about 0.5: two passes).
    pub clean_ratio: f64,
    /// Non-zero words the verify passes found (must be 0).
    pub nonzero_words: u64,
}

/// `gpu-bench fill`: how much memory now holds the pattern.
#[derive(Debug, Clone, Serialize)]
pub struct FillReport {
    pub device_uuid: String,
    pub pattern: u32,
    pub bytes_filled: u64,
    pub bytes_total: u64,
    pub chunks: u32,
    pub seconds: f64,
}

/// `gpu-bench count`: how many words of freshly allocated memory hold the pattern.
#[derive(Debug, Clone, Serialize)]
pub struct CountReport {
    pub device_uuid: String,
    pub pattern: u32,
    pub matching_words: u64,
    pub bytes_scanned: u64,
    pub bytes_total: u64,
    pub chunks: u32,
    pub seconds: f64,
}

impl CudaScrubber {
    /// A scrubber with the default options; [`ScrubError::NoDriver`] without `libcuda`.
    pub fn new() -> Result<CudaScrubber, ScrubError> {
        CudaScrubber::with_options(CudaOptions::default())
    }

    pub fn with_options(opts: CudaOptions) -> Result<CudaScrubber, ScrubError> {
        if !driver_present() {
            return Err(ScrubError::NoDriver);
        }
        if opts.min_chunk < GRANULE || opts.max_chunk < opts.min_chunk || opts.block_threads == 0 {
            return Err(ScrubError::Usage(format!("bad CUDA scrub options: {opts:?}")));
        }
        Ok(CudaScrubber { opts })
    }

    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// Measure plain `cuMemsetD32` bandwidth on one buffer (`bytes`, or all free memory
    /// less the reserve), then run the scrub's zero and verify passes on the same buffer,
    /// `reps` times each, best of each kept.
    pub fn memset_peak(&self, bytes: Option<u64>, reps: u32) -> Result<PeakReport, ScrubError> {
        guarded(|| {
            let gpu = Gpu::open(&self.opts)?;
            let (free, _) = gpu.mem_info()?;
            let avail = free.saturating_sub(self.opts.reserve_bytes);
            let target = bytes.map_or(avail, |b| b.min(avail));
            let buf = gpu.alloc_all(target)?;
            let reps = reps.max(1);
            let total = buf.bytes();
            let (start, end) = (gpu.event()?, gpu.event()?);

            // Warm up: the first touch of fresh allocations can be slower.
            buf.memset(0xA5A5_A5A5)?;
            gpu.sync()?;

            let mut memset_async_gbps: f64 = 0.0;
            let mut memset_sync_gbps: f64 = 0.0;
            for rep in 0..reps {
                start.record(gpu.stream)?;
                buf.memset(0xA5A5_A5A5 ^ rep)?;
                end.record(gpu.stream)?;
                gpu.sync()?;
                memset_async_gbps = memset_async_gbps.max(gbps(total, start.seconds_to(&end)?));

                let t = Instant::now();
                buf.memset_sync(0x5A5A_5A5A ^ rep)?;
                gpu.ctx_sync()?;
                memset_sync_gbps = memset_sync_gbps.max(gbps(total, t.elapsed().as_secs_f64()));
            }

            let (mut zero_best, mut verify_best, mut both_best) = (f64::MAX, f64::MAX, f64::MAX);
            let mut nonzero_words = 0;
            for rep in 0..reps {
                // Dirty the buffer so each pass really has something to erase.
                buf.memset(0xC3C3_C3C3 ^ rep)?;
                gpu.sync()?;
                let pass = buf.zero_and_verify()?;
                nonzero_words += pass.nonzero_words;
                zero_best = zero_best.min(pass.zero_seconds);
                verify_best = verify_best.min(pass.verify_seconds);
                both_best = both_best.min(pass.zero_seconds + pass.verify_seconds);
            }
            let memset_peak_gbps = memset_async_gbps.max(memset_sync_gbps);
            let scrub_gbps = gbps(total.saturating_mul(2), both_best);
            let scrub_clean_gbps = gbps(total, both_best);
            let scrub_zero_gbps = gbps(total, zero_best);
            let ratio = |x: f64| if memset_peak_gbps > 0.0 { x / memset_peak_gbps } else { 0.0 };
            Ok(PeakReport {
                device_name: gpu.name(),
                device_uuid: gpu.uuid_string()?,
                bytes: total,
                chunks: buf.count(),
                reps,
                memset_async_gbps,
                memset_sync_gbps,
                memset_peak_gbps,
                scrub_zero_gbps,
                scrub_verify_gbps: gbps(total, verify_best),
                scrub_gbps,
                scrub_clean_gbps,
                ratio: ratio(scrub_gbps),
                zero_ratio: ratio(scrub_zero_gbps),
                clean_ratio: ratio(scrub_clean_gbps),
                nonzero_words,
            })
        })
    }

    /// Fill all free memory (less the reserve) with `pattern`, then release it: process A
    /// of the leak test.
    pub fn fill_pattern(&self, pattern: u32) -> Result<FillReport, ScrubError> {
        guarded(|| {
            let started = Instant::now();
            let gpu = Gpu::open(&self.opts)?;
            let (free, total) = gpu.mem_info()?;
            let buf = gpu.alloc_all(free.saturating_sub(self.opts.reserve_bytes))?;
            buf.memset(pattern)?;
            gpu.sync()?;
            let (bytes_filled, chunks) = (buf.bytes(), buf.count());
            drop(buf);
            Ok(FillReport {
                device_uuid: gpu.uuid_string()?,
                pattern,
                bytes_filled,
                bytes_total: total,
                chunks,
                seconds: started.elapsed().as_secs_f64(),
            })
        })
    }

    /// Allocate all free memory (less the reserve) and count the words holding `pattern`,
    /// without writing anything: process B of the leak test.
    pub fn count_pattern(&self, pattern: u32) -> Result<CountReport, ScrubError> {
        guarded(|| {
            let started = Instant::now();
            let gpu = Gpu::open(&self.opts)?;
            let (free, total) = gpu.mem_info()?;
            let buf = gpu.alloc_all(free.saturating_sub(self.opts.reserve_bytes))?;
            gpu.reset_counter()?;
            for &(ptr, bytes) in &buf.chunks {
                gpu.launch_count(gpu.count_eq, ptr, bytes, pattern)?;
            }
            gpu.sync()?;
            let matching_words = gpu.read_counter()?;
            let (bytes_scanned, chunks) = (buf.bytes(), buf.count());
            drop(buf);
            Ok(CountReport {
                device_uuid: gpu.uuid_string()?,
                pattern,
                matching_words,
                bytes_scanned,
                bytes_total: total,
                chunks,
                seconds: started.elapsed().as_secs_f64(),
            })
        })
    }
}

impl Scrubber for CudaScrubber {
    fn backend(&self) -> &'static str {
        BACKEND_CUDA
    }

    fn scrub(&self, device_uuid: &str) -> Result<ScrubReport, ScrubError> {
        guarded(|| {
            let gpu = Gpu::open(&self.opts)?;
            gpu.check_device(device_uuid)?;
            let started = Instant::now();
            let (free, total) = gpu.mem_info()?;
            let buf = gpu.alloc_all(free.saturating_sub(self.opts.reserve_bytes))?;
            let pass = buf.zero_and_verify()?;
            let (covered, chunks) = (buf.bytes(), buf.count());
            drop(buf);
            Ok(ScrubReport {
                device: device_uuid.to_string(),
                backend: BACKEND_CUDA.to_string(),
                ok: false,
                error: None,
                bytes_covered: covered,
                bytes_total: total,
                nonzero_words: pass.nonzero_words,
                seconds: started.elapsed().as_secs_f64(),
                gbps: 0.0,
                zero_seconds: pass.zero_seconds,
                verify_seconds: pass.verify_seconds,
                zero_gbps: 0.0,
                verify_gbps: 0.0,
                chunks,
                finished_unix_s: 0,
            }
            .finish())
        })
    }
}

/// Run a driver session, turning a panic inside cudarc into an error.
fn guarded<T>(f: impl FnOnce() -> Result<T, ScrubError>) -> Result<T, ScrubError> {
    if !driver_present() {
        return Err(ScrubError::NoDriver);
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".to_string());
            Err(ScrubError::DriverPanic(msg))
        }
    }
}

fn drv<T>(call: &'static str, r: Result<T, DriverError>) -> Result<T, ScrubError> {
    r.map_err(|e| ScrubError::Driver { call, code: format!("{:?}", e.0) })
}

fn drv_raw(call: &'static str, r: sys::CUresult) -> Result<(), ScrubError> {
    drv(call, r.result())
}

/// Canonical lowercase `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` of a `GPU-…`/`MIG-…` uuid,
/// `None` for other forms (the old `MIG-GPU-<uuid>/<gi>/<ci>` names).
pub(crate) fn canonical_uuid(s: &str) -> Option<String> {
    let rest = s
        .strip_prefix("GPU-")
        .or_else(|| s.strip_prefix("MIG-"))
        .or_else(|| s.strip_prefix("gpu-"))
        .or_else(|| s.strip_prefix("mig-"))
        .unwrap_or(s);
    let groups: Vec<&str> = rest.split('-').collect();
    let shape_ok = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.chars().all(|c| c.is_ascii_hexdigit()));
    shape_ok.then(|| rest.to_ascii_lowercase())
}

pub(crate) fn format_uuid(bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// One driver session on ordinal 0: the primary context made current on this thread,
/// a stream, the verify module, and an 8-byte device counter. Everything is released
/// in `Drop`, in reverse order.
struct Gpu {
    dev: sys::CUdevice,
    stream: sys::CUstream,
    module: sys::CUmodule,
    count_ne: sys::CUfunction,
    count_eq: sys::CUfunction,
    counter: sys::CUdeviceptr,
    sms: u32,
    opts: CudaOptions,
    ctx_retained: bool,
}

struct Pass {
    zero_seconds: f64,
    verify_seconds: f64,
    nonzero_words: u64,
}

impl Gpu {
    fn open(opts: &CudaOptions) -> Result<Gpu, ScrubError> {
        if !driver_present() {
            return Err(ScrubError::NoDriver);
        }
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        match result::init() {
            Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => {
                return Err(ScrubError::NoDevice { visible })
            }
            r => drv("cuInit", r)?,
        }
        if drv("cuDeviceGetCount", result::device::get_count())? < 1 {
            return Err(ScrubError::NoDevice { visible });
        }
        let dev = drv("cuDeviceGet", result::device::get(0))?;
        let mut gpu = Gpu {
            dev,
            stream: ptr::null_mut(),
            module: ptr::null_mut(),
            count_ne: ptr::null_mut(),
            count_eq: ptr::null_mut(),
            counter: 0,
            sms: 1,
            opts: opts.clone(),
            ctx_retained: false,
        };
        // SAFETY: `dev` came from cuDeviceGet; the retain is released in Drop.
        let ctx = drv("cuDevicePrimaryCtxRetain", unsafe { result::primary_ctx::retain(dev) })?;
        gpu.ctx_retained = true;
        // SAFETY: `ctx` is the primary context just retained, alive until Drop.
        drv("cuCtxSetCurrent", unsafe { result::ctx::set_current(ctx) })?;
        gpu.stream =
            drv("cuStreamCreate", result::stream::create(result::stream::StreamKind::NonBlocking))?;
        gpu.module = load_module(ptx::PTX)?;
        gpu.count_ne = gpu.function(ptx::ENTRY_COUNT_NE)?;
        gpu.count_eq = gpu.function(ptx::ENTRY_COUNT_EQ)?;
        // SAFETY: `dev` came from cuDeviceGet.
        let sms = drv("cuDeviceGetAttribute", unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        })?;
        gpu.sms = u32::try_from(sms).unwrap_or(1).max(1);
        // SAFETY: a plain allocation in the current context, freed in Drop.
        gpu.counter = drv("cuMemAlloc", unsafe { result::malloc_sync(8) })?;
        Ok(gpu)
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction, ScrubError> {
        let cname = CString::new(name).map_err(|e| ScrubError::Usage(e.to_string()))?;
        // SAFETY: `self.module` is a module loaded in Gpu::open and not yet unloaded.
        drv("cuModuleGetFunction", unsafe { result::module::get_function(self.module, cname) })
    }

    fn name(&self) -> String {
        result::device::get_name(self.dev).unwrap_or_else(|e| format!("unknown ({:?})", e.0))
    }

    fn uuid_string(&self) -> Result<String, ScrubError> {
        let mut uuid = MaybeUninit::<sys::CUuuid>::uninit();
        // SAFETY: `uuid` is a writable CUuuid; `self.dev` came from cuDeviceGet. The _v2
        // call returns the MIG instance's uuid on a MIG device.
        drv_raw("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(uuid.as_mut_ptr(), self.dev)
        })?;
        // SAFETY: the call succeeded, so it wrote all 16 bytes.
        let uuid = unsafe { uuid.assume_init() };
        Ok(format_uuid(&uuid.bytes.map(|b| b as u8)))
    }

    /// Refuse to scrub a device other than the one asked for.
    fn check_device(&self, requested: &str) -> Result<(), ScrubError> {
        let found = self.uuid_string()?;
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let selected_by_env = visible.as_deref() == Some(requested);
        match canonical_uuid(requested) {
            Some(want) if want == found => Ok(()),
            // CUDA_VISIBLE_DEVICES=<requested> shows exactly that device as ordinal 0 (an
            // unknown uuid shows none): trust it even if the driver spells MIG uuids
            // differently from NVML, and say so.
            _ if selected_by_env => {
                tracing::warn!(
                    requested,
                    found,
                    "device uuid differs from the requested one; trusting CUDA_VISIBLE_DEVICES"
                );
                Ok(())
            }
            _ => Err(ScrubError::WrongDevice { requested: requested.to_string(), found }),
        }
    }

    fn mem_info(&self) -> Result<(u64, u64), ScrubError> {
        let (free, total) = drv("cuMemGetInfo", result::mem_get_info())?;
        Ok((free as u64, total as u64))
    }

    /// Allocate `target` bytes (rounded down to 2 MiB) in chunks of at most `max_chunk`,
    /// halving the chunk on out-of-memory down to `min_chunk`, then stopping.
    fn alloc_all(&self, target: u64) -> Result<Chunks<'_>, ScrubError> {
        let mut chunks = Chunks { gpu: self, chunks: Vec::new() };
        let mut remaining = target - target % GRANULE;
        let mut cap = self.opts.max_chunk - self.opts.max_chunk % GRANULE;
        while remaining >= GRANULE {
            let size = remaining.min(cap);
            let size_usize = usize::try_from(size).unwrap_or(usize::MAX);
            // SAFETY: a plain allocation in the current context; Chunks frees it.
            match unsafe { result::malloc_sync(size_usize) } {
                Ok(ptr) => {
                    chunks.chunks.push((ptr, size));
                    remaining -= size;
                }
                Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                    if size <= self.opts.min_chunk {
                        break;
                    }
                    let half = (size / 2).max(self.opts.min_chunk);
                    cap = (half - half % GRANULE).max(GRANULE);
                }
                Err(e) => {
                    return Err(ScrubError::Driver {
                        call: "cuMemAlloc",
                        code: format!("{:?}", e.0),
                    })
                }
            }
        }
        if chunks.chunks.is_empty() {
            return Err(ScrubError::NoMemory { free: target });
        }
        tracing::debug!(bytes = chunks.bytes(), chunks = chunks.count(), "allocated");
        Ok(chunks)
    }

    fn event(&self) -> Result<Event, ScrubError> {
        let ev = drv("cuEventCreate", result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(Event(ev))
    }

    fn sync(&self) -> Result<(), ScrubError> {
        // SAFETY: `self.stream` is a live stream of the current context.
        drv("cuStreamSynchronize", unsafe { result::stream::synchronize(self.stream) })
    }

    fn ctx_sync(&self) -> Result<(), ScrubError> {
        drv("cuCtxSynchronize", result::ctx::synchronize())
    }

    fn reset_counter(&self) -> Result<(), ScrubError> {
        // SAFETY: `self.counter` is a live 8-byte allocation: two 32-bit words.
        drv_raw("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(self.counter, 0, 2, self.stream)
        })
    }

    /// Read the counter (the stream must have been synchronised).
    fn read_counter(&self) -> Result<u64, ScrubError> {
        let mut host = [0u64; 1];
        // SAFETY: `self.counter` holds 8 bytes, `host` is 8 writable bytes; the copy is
        // synchronous and the stream that wrote the counter was synchronised.
        drv("cuMemcpyDtoH", unsafe { result::memcpy_dtoh_sync(&mut host, self.counter) })?;
        Ok(host[0])
    }

    /// Launch `f` (one of the module's count kernels) over `bytes` bytes at `data`,
    /// adding to the counter.
    fn launch_count(
        &self,
        f: sys::CUfunction,
        data: sys::CUdeviceptr,
        bytes: u64,
        value: u32,
    ) -> Result<(), ScrubError> {
        let nvec = bytes / ptx::VECTOR_BYTES;
        if nvec == 0 {
            return Ok(());
        }
        let threads = u64::from(self.opts.block_threads);
        let max_blocks = u64::from(self.sms) * u64::from(self.opts.blocks_per_sm.max(1));
        let blocks = nvec.div_ceil(threads).clamp(1, max_blocks);
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        let (mut p_data, mut p_nvec, mut p_value, mut p_counter) =
            (data, nvec, value, self.counter);
        let mut params: [*mut c_void; 4] = [
            ptr::addr_of_mut!(p_data).cast(),
            ptr::addr_of_mut!(p_nvec).cast(),
            ptr::addr_of_mut!(p_value).cast(),
            ptr::addr_of_mut!(p_counter).cast(),
        ];
        // SAFETY: `f` is a kernel of the loaded module with parameters (u64, u64, u32,
        // u64), and `params` points at locals of exactly those types, alive across the
        // call (cuLaunchKernel copies the values before returning). The kernel reads
        // `nvec * 16` bytes from `data`, which lie in one live allocation (chunks are
        // multiples of 2 MiB), and adds to the live 8-byte counter.
        drv("cuLaunchKernel", unsafe {
            result::launch_kernel(
                f,
                (blocks, 1, 1),
                (self.opts.block_threads, 1, 1),
                0,
                self.stream,
                &mut params,
            )
        })
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: every handle below was created by this Gpu in the primary context,
        // which is still retained and current on this thread; each is released once, after
        // the stream is drained so no queued work still uses them. Errors are ignored:
        // the process is about to exit or move on, and the driver reclaims the rest.
        unsafe {
            if !self.stream.is_null() {
                let _ = result::stream::synchronize(self.stream);
            }
            if self.counter != 0 {
                let _ = result::free_sync(self.counter);
            }
            if !self.module.is_null() {
                let _ = result::module::unload(self.module);
            }
            if !self.stream.is_null() {
                let _ = result::stream::destroy(self.stream);
            }
            if self.ctx_retained {
                let _ = result::primary_ctx::release(self.dev);
            }
        }
    }
}

/// Load PTX text, with the JIT's error log on failure.
fn load_module(ptx_text: &str) -> Result<sys::CUmodule, ScrubError> {
    let image = CString::new(ptx_text).map_err(|e| ScrubError::Usage(format!("PTX: {e}")))?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The size option's value is passed in the pointer itself, as the API wants.
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    let mut module = MaybeUninit::<sys::CUmodule>::uninit();
    // SAFETY: `image` is NUL-terminated PTX alive across the call; `options` and `values`
    // are two matching entries: a writable buffer of `log.len()` bytes and its size.
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            module.as_mut_ptr(),
            image.as_ptr().cast(),
            2,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    match r.result() {
        // SAFETY: the call succeeded and wrote the module handle.
        Ok(()) => Ok(unsafe { module.assume_init() }),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            Err(ScrubError::Jit {
                code: format!("{:?}", e.0),
                log: String::from_utf8_lossy(&log[..end]).trim().to_string(),
            })
        }
    }
}

/// A CUDA event, destroyed on drop.
struct Event(sys::CUevent);

impl Event {
    fn record(&self, stream: sys::CUstream) -> Result<(), ScrubError> {
        // SAFETY: `self.0` is a live event and `stream` a live stream of the same context.
        drv("cuEventRecord", unsafe { result::event::record(self.0, stream) })
    }

    /// Seconds from this event to `end`, both recorded and complete.
    fn seconds_to(&self, end: &Event) -> Result<f64, ScrubError> {
        // SAFETY: both events are live, recorded on the same stream, and the stream was
        // synchronised, so both are complete.
        let ms = drv("cuEventElapsedTime", unsafe { result::event::elapsed(self.0, end.0) })?;
        Ok(f64::from(ms) / 1e3)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event was created by cuEventCreate and is destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// Device allocations of one session, freed on drop (before the session's context).
struct Chunks<'g> {
    gpu: &'g Gpu,
    chunks: Vec<(sys::CUdeviceptr, u64)>,
}

impl Chunks<'_> {
    fn bytes(&self) -> u64 {
        self.chunks.iter().map(|&(_, b)| b).sum()
    }

    fn count(&self) -> u32 {
        u32::try_from(self.chunks.len()).unwrap_or(u32::MAX)
    }

    /// Queue `cuMemsetD32Async(value)` over every chunk on the session's stream.
    fn memset(&self, value: u32) -> Result<(), ScrubError> {
        for &(ptr, bytes) in &self.chunks {
            let words = usize::try_from(bytes / 4).unwrap_or(usize::MAX);
            // SAFETY: `ptr` is a live allocation of `bytes` bytes (a multiple of 4), so
            // `bytes / 4` words fit; the stream belongs to the current context.
            drv_raw("cuMemsetD32Async", unsafe {
                sys::cuMemsetD32Async(ptr, value, words, self.gpu.stream)
            })?;
        }
        Ok(())
    }

    /// Plain synchronous-API `cuMemsetD32` over every chunk (for the peak measurement).
    fn memset_sync(&self, value: u32) -> Result<(), ScrubError> {
        for &(ptr, bytes) in &self.chunks {
            let words = usize::try_from(bytes / 4).unwrap_or(usize::MAX);
            // SAFETY: as in `memset`.
            drv_raw("cuMemsetD32", unsafe { sys::cuMemsetD32_v2(ptr, value, words) })?;
        }
        Ok(())
    }

    /// The scrub proper: zero every chunk, then count non-zero words in every chunk.
    fn zero_and_verify(&self) -> Result<Pass, ScrubError> {
        let gpu = self.gpu;
        let (t0, t1, t2) = (gpu.event()?, gpu.event()?, gpu.event()?);
        gpu.reset_counter()?;
        t0.record(gpu.stream)?;
        self.memset(0)?;
        t1.record(gpu.stream)?;
        for &(ptr, bytes) in &self.chunks {
            gpu.launch_count(gpu.count_ne, ptr, bytes, 0)?;
        }
        t2.record(gpu.stream)?;
        gpu.sync()?;
        Ok(Pass {
            zero_seconds: t0.seconds_to(&t1)?,
            verify_seconds: t1.seconds_to(&t2)?,
            nonzero_words: gpu.read_counter()?,
        })
    }
}

impl Drop for Chunks<'_> {
    fn drop(&mut self) {
        // Drain queued work before freeing what it uses.
        let _ = self.gpu.sync();
        for &(ptr, _) in &self.chunks {
            // SAFETY: each pointer came from cuMemAlloc in this session and is freed once;
            // the stream using it was synchronised just above.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        if driver_present() {
            eprintln!("libcuda present: the no-driver path can't be checked here");
            return;
        }
        assert!(matches!(CudaScrubber::new(), Err(ScrubError::NoDriver)));
        let s = CudaScrubber { opts: CudaOptions::default() };
        assert!(matches!(s.scrub("GPU-x"), Err(ScrubError::NoDriver)));
        assert!(matches!(s.memset_peak(None, 1), Err(ScrubError::NoDriver)));
        assert!(matches!(s.fill_pattern(1), Err(ScrubError::NoDriver)));
        assert!(matches!(s.count_pattern(1), Err(ScrubError::NoDriver)));
    }

    #[test]
    fn uuid_forms() {
        let u = "5b1e3c1a-7d2f-5e8b-9a4c-0d1e2f3a4b5c";
        assert_eq!(canonical_uuid(&format!("GPU-{u}")).as_deref(), Some(u));
        assert_eq!(canonical_uuid(&format!("MIG-{}", u.to_uppercase())).as_deref(), Some(u));
        assert_eq!(canonical_uuid(u).as_deref(), Some(u));
        assert_eq!(canonical_uuid(&format!("MIG-GPU-{u}/1/0")), None);
        assert_eq!(canonical_uuid("GPU-xyz"), None);
        let bytes: [u8; 16] = [
            0x5b, 0x1e, 0x3c, 0x1a, 0x7d, 0x2f, 0x5e, 0x8b, 0x9a, 0x4c, 0x0d, 0x1e, 0x2f, 0x3a,
            0x4b, 0x5c,
        ];
        assert_eq!(format_uuid(&bytes), u);
    }

    #[test]
    fn option_checks() {
        if !driver_present() {
            return; // with_options reports NoDriver first
        }
        let bad = CudaOptions { min_chunk: 4096, ..CudaOptions::default() };
        assert!(matches!(CudaScrubber::with_options(bad), Err(ScrubError::Usage(_))));
    }
}
