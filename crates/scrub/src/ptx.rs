//! The verify kernels, as PTX written by hand and embedded in the binary (no nvcc at build
//! time; the driver JIT-compiles it for the device at load, sm_80 PTX running on sm_80
//! and anything newer: A100, H100, H200).
//!
//! Both kernels take `(const u32x4 *data, u64 nvec, u32 value, u64 *counter)`, walk the
//! `nvec` 16-byte vectors of `data` in a grid-stride loop with 128-bit streaming loads,
//! count per thread the 32-bit words that differ from (`tessera_count_ne`) or equal
//! (`tessera_count_eq`) `value`, and add a thread's count to `*counter` with one atomic,
//! only when it is not zero: a clean buffer costs no atomics at all.
//!
//! Equivalent CUDA C, for review:
//! ```c
//! __global__ void tessera_count_ne(const uint4 *data, unsigned long long nvec,
//!                                  unsigned value, unsigned long long *counter) {
//!     unsigned long long n = 0;
//!     for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
//!          i < nvec; i += gridDim.x * (unsigned long long)blockDim.x) {
//!         uint4 v = __ldcs(&data[i]);
//!         n += (v.x != value) + (v.y != value) + (v.z != value) + (v.w != value);
//!     }
//!     if (n) atomicAdd(counter, n);
//! }
//! ```
//!
//! Checked with `ptxas -arch=sm_80` and `-arch=sm_90` (ptxas 12.9) when written; the
//! test `ptx_assembles_with_ptxas` repeats that wherever a `ptxas` is found (`PTXAS`
//! environment variable, or on `PATH`).

/// Kernel counting words that differ from `value` (the verify pass: `value` = 0).
pub const ENTRY_COUNT_NE: &str = "tessera_count_ne";
/// Kernel counting words equal to `value` (the leak test).
pub const ENTRY_COUNT_EQ: &str = "tessera_count_eq";

/// Bytes each kernel thread loads per iteration: data must be a multiple of this.
pub const VECTOR_BYTES: u64 = 16;

/// The PTX module. No NUL inside; the loader appends one.
pub const PTX: &str = r#"//
// Tessera scrub verify kernels (hand-written PTX; see crates/scrub/src/ptx.rs).
//
.version 7.0
.target sm_80
.address_size 64

.visible .entry tessera_count_ne(
	.param .u64 tessera_count_ne_data,
	.param .u64 tessera_count_ne_nvec,
	.param .u32 tessera_count_ne_value,
	.param .u64 tessera_count_ne_counter
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<11>;

	ld.param.u64 	%rd1, [tessera_count_ne_data];
	ld.param.u64 	%rd2, [tessera_count_ne_nvec];
	ld.param.u32 	%r1, [tessera_count_ne_value];
	ld.param.u64 	%rd3, [tessera_count_ne_counter];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd3, %rd3;
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %tid.x;
	mov.u32 	%r5, %nctaid.x;
	mul.wide.u32 	%rd4, %r2, %r3;
	cvt.u64.u32 	%rd5, %r4;
	add.s64 	%rd4, %rd4, %rd5;
	mul.wide.u32 	%rd6, %r5, %r3;
	mov.u64 	%rd7, 0;
	setp.ge.u64 	%p1, %rd4, %rd2;
	@%p1 bra 	$NE_DONE;
$NE_LOOP:
	shl.b64 	%rd8, %rd4, 4;
	add.s64 	%rd9, %rd1, %rd8;
	ld.global.cs.v4.u32 	{%r6, %r7, %r8, %r9}, [%rd9];
	setp.ne.u32 	%p2, %r6, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.ne.u32 	%p2, %r7, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.ne.u32 	%p2, %r8, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.ne.u32 	%p2, %r9, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	add.s64 	%rd4, %rd4, %rd6;
	setp.lt.u64 	%p1, %rd4, %rd2;
	@%p1 bra 	$NE_LOOP;
$NE_DONE:
	setp.eq.u64 	%p1, %rd7, 0;
	@%p1 bra 	$NE_END;
	red.global.add.u64 	[%rd3], %rd7;
$NE_END:
	ret;
}

.visible .entry tessera_count_eq(
	.param .u64 tessera_count_eq_data,
	.param .u64 tessera_count_eq_nvec,
	.param .u32 tessera_count_eq_value,
	.param .u64 tessera_count_eq_counter
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<11>;

	ld.param.u64 	%rd1, [tessera_count_eq_data];
	ld.param.u64 	%rd2, [tessera_count_eq_nvec];
	ld.param.u32 	%r1, [tessera_count_eq_value];
	ld.param.u64 	%rd3, [tessera_count_eq_counter];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd3, %rd3;
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %tid.x;
	mov.u32 	%r5, %nctaid.x;
	mul.wide.u32 	%rd4, %r2, %r3;
	cvt.u64.u32 	%rd5, %r4;
	add.s64 	%rd4, %rd4, %rd5;
	mul.wide.u32 	%rd6, %r5, %r3;
	mov.u64 	%rd7, 0;
	setp.ge.u64 	%p1, %rd4, %rd2;
	@%p1 bra 	$EQ_DONE;
$EQ_LOOP:
	shl.b64 	%rd8, %rd4, 4;
	add.s64 	%rd9, %rd1, %rd8;
	ld.global.cs.v4.u32 	{%r6, %r7, %r8, %r9}, [%rd9];
	setp.eq.u32 	%p2, %r6, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.eq.u32 	%p2, %r7, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.eq.u32 	%p2, %r8, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.eq.u32 	%p2, %r9, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	add.s64 	%rd4, %rd4, %rd6;
	setp.lt.u64 	%p1, %rd4, %rd2;
	@%p1 bra 	$EQ_LOOP;
$EQ_DONE:
	setp.eq.u64 	%p1, %rd7, 0;
	@%p1 bra 	$EQ_END;
	red.global.add.u64 	[%rd3], %rd7;
$EQ_END:
	ret;
}
"#;

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The body of the entry `name`, between its braces.
    fn body(name: &str) -> &'static str {
        let start = PTX.find(&format!(".visible .entry {name}(")).expect("entry present");
        let open = start + PTX[start..].find('{').expect("body opens");
        let close = open + PTX[open..].find('}').expect("body closes");
        &PTX[open + 1..close]
    }

    #[test]
    fn header_and_entries_are_well_formed() {
        assert!(!PTX.contains('\0'));
        let directives: Vec<&str> =
            PTX.lines().filter(|l| l.starts_with('.') && !l.starts_with(".visible")).collect();
        assert_eq!(directives, [".version 7.0", ".target sm_80", ".address_size 64"]);
        let entries: Vec<&str> = PTX
            .lines()
            .filter_map(|l| l.strip_prefix(".visible .entry "))
            .map(|l| l.trim_end_matches('('))
            .collect();
        assert_eq!(entries, [ENTRY_COUNT_NE, ENTRY_COUNT_EQ]);
        assert_eq!(PTX.matches('{').count(), PTX.matches('}').count());
        for name in [ENTRY_COUNT_NE, ENTRY_COUNT_EQ] {
            // Four params, in order, named after the entry.
            let sig_start = PTX.find(&format!("{name}(")).unwrap();
            let sig = &PTX[sig_start..sig_start + PTX[sig_start..].find(')').unwrap()];
            let params: Vec<&str> = sig.lines().skip(1).map(str::trim).collect();
            assert_eq!(
                params,
                [
                    format!(".param .u64 {name}_data,"),
                    format!(".param .u64 {name}_nvec,"),
                    format!(".param .u32 {name}_value,"),
                    format!(".param .u64 {name}_counter"),
                ]
            );
        }
    }

    #[test]
    fn bodies_use_declared_registers_and_defined_labels_only() {
        for name in [ENTRY_COUNT_NE, ENTRY_COUNT_EQ] {
            let b = body(name);
            let mut labels = BTreeSet::new();
            let mut targets = BTreeSet::new();
            for line in b.lines().map(str::trim).filter(|l| !l.is_empty()) {
                if let Some(label) = line.strip_suffix(':') {
                    assert!(labels.insert(label), "label {label} defined twice in {name}");
                    continue;
                }
                assert!(line.ends_with(';'), "unterminated statement in {name}: {line}");
                if let Some(at) = line.find("bra") {
                    targets.insert(line[at + 3..].trim().trim_end_matches(';'));
                }
                // Registers: %p0..2, %r0..9, %rd0..10 as declared.
                for (i, _) in line.match_indices('%') {
                    let reg: String = line[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '.')
                        .collect();
                    let (class, num) = reg.split_at(reg.find(|c: char| c.is_ascii_digit()).unwrap_or(reg.len()));
                    let limit = match class {
                        "p" => 3,
                        "r" => 10,
                        "rd" => 11,
                        _ => continue, // %tid.x and friends
                    };
                    let n: u32 = num.parse().unwrap_or_else(|_| panic!("bad register {reg}"));
                    assert!(n < limit, "{name}: %{reg} beyond its declaration");
                }
            }
            assert_eq!(targets, labels, "{name}: branch targets and labels differ");
            assert!(b.contains("red.global.add.u64"));
            assert!(b.trim_end().ends_with("ret;"));
        }
        assert!(body(ENTRY_COUNT_NE).contains("setp.ne.u32") && !body(ENTRY_COUNT_NE).contains("setp.eq.u32"));
        assert!(body(ENTRY_COUNT_EQ).contains("setp.eq.u32") && !body(ENTRY_COUNT_EQ).contains("setp.ne.u32"));
    }

    /// Assemble with a real ptxas where one is available (not on CI: no CUDA toolkit).
    #[test]
    fn ptx_assembles_with_ptxas() {
        let ptxas = std::env::var_os("PTXAS")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("PATH").and_then(|paths| {
                    std::env::split_paths(&paths).map(|d| d.join("ptxas")).find(|p| p.is_file())
                })
            });
        let Some(ptxas) = ptxas else {
            eprintln!("ptxas not found: skipping the assembly check");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("scrub.ptx");
        std::fs::write(&src, PTX).unwrap();
        for arch in ["sm_80", "sm_90"] {
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-o")
                .arg(dir.path().join(format!("{arch}.cubin")))
                .arg(&src)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ptxas {arch}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
