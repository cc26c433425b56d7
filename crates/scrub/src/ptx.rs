//! The verify kernels, as PTX written by hand and embedded in the binary (no nvcc at build
//! time; the driver JIT-compiles it for the device at load, sm_80 PTX running on sm_80
//! and anything newer: A100, H100, H200).
//!
//! Both kernels take `(const u32x4 *data, u64 nvec, u32 value, u64 *counter)`, walk the
//! `nvec` 16-byte vectors of `data` in a grid-stride loop with 128-bit streaming loads,
//! two vectors per iteration (both loads issued before either is used, so twice the bytes
//! are in flight), count per thread the 32-bit words that differ from
//! (`tessera_count_ne`) or equal (`tessera_count_eq`) `value`, and add a thread's count
//! to `*counter` with one atomic, only when it is not zero: a clean buffer costs no
//! atomics at all.
//!
//! Equivalent CUDA C, for review:
//! ```c
//! __global__ void tessera_count_ne(const uint4 *data, unsigned long long nvec,
//!                                  unsigned value, unsigned long long *counter) {
//!     unsigned long long stride = gridDim.x * (unsigned long long)blockDim.x;
//!     unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
//!     unsigned long long n = 0;
//!     #define COUNT(v) ((v.x != value) + (v.y != value) + (v.z != value) + (v.w != value))
//!     for (; i + stride < nvec; i += 2 * stride) {      // PAIR
//!         uint4 a = __ldcs(&data[i]), b = __ldcs(&data[i + stride]);
//!         n += COUNT(a) + COUNT(b);
//!     }
//!     if (i < nvec) { uint4 a = __ldcs(&data[i]); n += COUNT(a); }   // TAIL
//!     if (n) atomicAdd(counter, n);                       // DONE
//! }
//! ```
//! Every index `i0 + k*stride < nvec` of a thread is visited exactly once: the pair loop
//! takes two while the second exists, and when it does not, the tail takes the first if
//! it exists; after that `i + stride >= nvec`, so nothing is left.
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
	.reg .b32 	%r<14>;
	.reg .b64 	%rd<15>;

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
	shl.b64 	%rd11, %rd6, 1;
	shl.b64 	%rd12, %rd6, 4;
	mov.u64 	%rd7, 0;
$NE_PAIR:
	add.s64 	%rd13, %rd4, %rd6;
	setp.ge.u64 	%p1, %rd13, %rd2;
	@%p1 bra 	$NE_TAIL;
	shl.b64 	%rd8, %rd4, 4;
	add.s64 	%rd9, %rd1, %rd8;
	add.s64 	%rd14, %rd9, %rd12;
	ld.global.cs.v4.u32 	{%r6, %r7, %r8, %r9}, [%rd9];
	ld.global.cs.v4.u32 	{%r10, %r11, %r12, %r13}, [%rd14];
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
	setp.ne.u32 	%p2, %r10, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.ne.u32 	%p2, %r11, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.ne.u32 	%p2, %r12, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.ne.u32 	%p2, %r13, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	add.s64 	%rd4, %rd4, %rd11;
	bra.uni 	$NE_PAIR;
$NE_TAIL:
	setp.ge.u64 	%p1, %rd4, %rd2;
	@%p1 bra 	$NE_DONE;
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
	.reg .b32 	%r<14>;
	.reg .b64 	%rd<15>;

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
	shl.b64 	%rd11, %rd6, 1;
	shl.b64 	%rd12, %rd6, 4;
	mov.u64 	%rd7, 0;
$EQ_PAIR:
	add.s64 	%rd13, %rd4, %rd6;
	setp.ge.u64 	%p1, %rd13, %rd2;
	@%p1 bra 	$EQ_TAIL;
	shl.b64 	%rd8, %rd4, 4;
	add.s64 	%rd9, %rd1, %rd8;
	add.s64 	%rd14, %rd9, %rd12;
	ld.global.cs.v4.u32 	{%r6, %r7, %r8, %r9}, [%rd9];
	ld.global.cs.v4.u32 	{%r10, %r11, %r12, %r13}, [%rd14];
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
	setp.eq.u32 	%p2, %r10, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.eq.u32 	%p2, %r11, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.eq.u32 	%p2, %r12, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	setp.eq.u32 	%p2, %r13, %r1;
	selp.u64 	%rd10, 1, 0, %p2;
	add.s64 	%rd7, %rd7, %rd10;
	add.s64 	%rd4, %rd4, %rd11;
	bra.uni 	$EQ_PAIR;
$EQ_TAIL:
	setp.ge.u64 	%p1, %rd4, %rd2;
	@%p1 bra 	$EQ_DONE;
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
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    /// The body of the entry `name`, between its braces.
    fn body(name: &str) -> &'static str {
        let start = PTX.find(&format!(".visible .entry {name}(")).expect("entry present");
        let open = start + PTX[start..].find('{').expect("body opens");
        // The body closes with a `}` alone at the start of a line (vector operands use
        // braces too).
        let close = open + PTX[open..].find("\n}").expect("body closes") + 1;
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
            // `.reg .b64 %rd<15>;` declares %rd0..%rd14.
            let decls: BTreeMap<&str, u32> = b
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with(".reg"))
                .map(|l| {
                    let at = l.find('%').unwrap();
                    let lt = l.find('<').unwrap();
                    let gt = l.find('>').unwrap();
                    (&l[at + 1..lt], l[lt + 1..gt].parse().unwrap())
                })
                .collect();
            assert_eq!(decls.len(), 3, "{name}: pred, b32 and b64 registers");
            for line in b.lines().map(str::trim).filter(|l| !l.is_empty()) {
                if let Some(label) = line.strip_suffix(':') {
                    assert!(labels.insert(label), "label {label} defined twice in {name}");
                    continue;
                }
                assert!(line.ends_with(';'), "unterminated statement in {name}: {line}");
                if line.starts_with(".reg") {
                    continue;
                }
                if let Some(at) = line.find("bra") {
                    let target = line[at + 3..].trim_start_matches(".uni");
                    targets.insert(target.trim().trim_end_matches(';'));
                }
                // Registers within their `.reg` declarations.
                for (i, _) in line.match_indices('%') {
                    let reg: String = line[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '.')
                        .collect();
                    let (class, num) =
                        reg.split_at(reg.find(|c: char| c.is_ascii_digit()).unwrap_or(reg.len()));
                    let Some(&limit) = decls.get(class) else {
                        continue; // %tid.x and friends
                    };
                    let n: u32 = num.parse().unwrap_or_else(|_| panic!("bad register {reg}"));
                    assert!(n < limit, "{name}: %{reg} beyond its declaration");
                }
            }
            assert_eq!(targets, labels, "{name}: branch targets and labels differ");
            assert!(b.contains("red.global.add.u64"));
            assert!(b.trim_end().ends_with("ret;"));
        }
        assert!(
            body(ENTRY_COUNT_NE).contains("setp.ne.u32")
                && !body(ENTRY_COUNT_NE).contains("setp.eq.u32")
        );
        assert!(
            body(ENTRY_COUNT_EQ).contains("setp.eq.u32")
                && !body(ENTRY_COUNT_EQ).contains("setp.ne.u32")
        );
    }

    /// Runs one thread of an entry of [`PTX`], for the instruction subset the kernels use.
    /// Memory is a map from byte address to 32-bit word (the counter: one u64 slot), so a
    /// read outside the buffer fails the test.
    struct Interp<'a> {
        params: Vec<&'a str>,
        lines: Vec<&'a str>,
        labels: BTreeMap<&'a str, usize>,
    }

    impl<'a> Interp<'a> {
        fn new(name: &str) -> Interp<'a> {
            let sig_start = PTX.find(&format!(".entry {name}(")).unwrap();
            let sig_end = sig_start + PTX[sig_start..].find(')').unwrap();
            let params = PTX[sig_start..sig_end]
                .lines()
                .skip(1)
                .map(|l| l.trim().trim_end_matches(',').rsplit(' ').next().unwrap())
                .collect();
            let lines: Vec<&str> = body(name)
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with(".reg"))
                .collect();
            let labels = lines
                .iter()
                .enumerate()
                .filter_map(|(i, l)| l.strip_suffix(':').map(|n| (n, i)))
                .collect();
            Interp { params, lines, labels }
        }

        fn run(
            &self,
            args: [u64; 4],
            mem: &mut BTreeMap<u64, u64>,
            ctaid: u64,
            ntid: u64,
            tid: u64,
            nctaid: u64,
        ) {
            let mut reg: BTreeMap<String, u64> = BTreeMap::new();
            let val = |reg: &BTreeMap<String, u64>, o: &str| -> u64 {
                match o.trim() {
                    "%ctaid.x" => ctaid,
                    "%ntid.x" => ntid,
                    "%tid.x" => tid,
                    "%nctaid.x" => nctaid,
                    r if r.starts_with('%') => reg[r],
                    n => n.parse().unwrap(),
                }
            };
            let mut pc = 0;
            for _ in 0..1_000_000 {
                let mut l = self.lines[pc].trim_end_matches(';');
                pc += 1;
                if l.ends_with(':') {
                    continue;
                }
                if let Some(rest) = l.strip_prefix('@') {
                    let (p, instr) = rest.split_once(char::is_whitespace).unwrap();
                    if reg[p] == 0 {
                        continue;
                    }
                    l = instr.trim();
                }
                let (op, rest) = l.split_once(char::is_whitespace).unwrap_or((l, ""));
                let rest = rest.trim();
                if op == "ret" {
                    return;
                }
                if op.starts_with("bra") {
                    pc = self.labels[rest];
                    continue;
                }
                if op.starts_with("ld.param") {
                    let (d, a) = rest.split_once(',').unwrap();
                    let a = a.trim().trim_matches(|c| c == '[' || c == ']');
                    let i = self.params.iter().position(|p| *p == a).unwrap();
                    reg.insert(d.trim().to_string(), args[i]);
                    continue;
                }
                if op == "ld.global.cs.v4.u32" {
                    let (regs, addr) = rest.split_once('}').unwrap();
                    let a = val(&reg, addr.trim_matches(|c: char| " ,[]".contains(c)));
                    for (k, r) in regs.trim_start_matches('{').split(',').enumerate() {
                        let w = *mem.get(&(a + 4 * k as u64)).expect("read inside the buffer");
                        reg.insert(r.trim().to_string(), w);
                    }
                    continue;
                }
                if op == "red.global.add.u64" {
                    let (addr, v) = rest.split_once(',').unwrap();
                    let a = val(&reg, addr.trim_matches(|c| c == '[' || c == ']'));
                    let add = val(&reg, v);
                    *mem.get_mut(&a).expect("counter") += add;
                    continue;
                }
                let ops: Vec<&str> = rest.split(',').map(str::trim).collect();
                let v = |i: usize| val(&reg, ops[i]);
                let out = match op.split('.').next().unwrap() {
                    "cvta" | "mov" | "cvt" => v(1),
                    "mul" => {
                        assert_eq!(op, "mul.wide.u32");
                        (v(1) & 0xffff_ffff) * (v(2) & 0xffff_ffff)
                    }
                    "add" => v(1).wrapping_add(v(2)),
                    "shl" => v(1) << v(2),
                    "setp" => u64::from(match op.split('.').nth(1).unwrap() {
                        "ne" => v(1) != v(2),
                        "eq" => v(1) == v(2),
                        "ge" => v(1) >= v(2),
                        "lt" => v(1) < v(2),
                        c => panic!("setp.{c}"),
                    }),
                    "selp" => {
                        if reg[ops[3]] != 0 {
                            v(1)
                        } else {
                            v(2)
                        }
                    }
                    _ => panic!("instruction outside the interpreted subset: {l}"),
                };
                reg.insert(ops[0].to_string(), out);
            }
            panic!("no ret after a million steps");
        }
    }

    /// The kernels count exactly the words they should, for grids and sizes that hit the
    /// pair loop, the tail and the empty case, and read nothing outside the buffer.
    #[test]
    fn kernels_count_correctly_in_an_interpreter() {
        let base = 0x7f00_0000_1000u64;
        let counter = 0x7f00_0000_0000u64;
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for nvec in [0u64, 1, 2, 5, 11, 12, 13, 24, 25, 37] {
            let words: Vec<u64> = (0..nvec * 4)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    [0, 0, 0, 7, 0xDEAD_BEEF][(seed % 5) as usize]
                })
                .collect();
            for (blocks, threads) in [(1, 1), (1, 4), (3, 4), (2, 3), (5, 8)] {
                for (name, value) in [
                    (ENTRY_COUNT_NE, 0u64),
                    (ENTRY_COUNT_NE, 7),
                    (ENTRY_COUNT_EQ, 0xDEAD_BEEF),
                    (ENTRY_COUNT_EQ, 0),
                ] {
                    let interp = Interp::new(name);
                    let mut mem: BTreeMap<u64, u64> =
                        words.iter().enumerate().map(|(i, &w)| (base + 4 * i as u64, w)).collect();
                    mem.insert(counter, 0);
                    for c in 0..blocks {
                        for t in 0..threads {
                            interp.run(
                                [base, nvec, value, counter],
                                &mut mem,
                                c,
                                threads,
                                t,
                                blocks,
                            );
                        }
                    }
                    let want = words
                        .iter()
                        .filter(|&&w| if name == ENTRY_COUNT_NE { w != value } else { w == value })
                        .count() as u64;
                    assert_eq!(mem[&counter], want, "{name} nvec={nvec} grid={blocks}x{threads}");
                }
            }
        }
    }

    /// Assemble with a real ptxas where one is available (not on CI: no CUDA toolkit).
    #[test]
    fn ptx_assembles_with_ptxas() {
        let ptxas = std::env::var_os("PTXAS").map(std::path::PathBuf::from).or_else(|| {
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
            assert!(out.status.success(), "ptxas {arch}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
}
