//! The node's GPU topology — which GPUs share an NVLink domain, which NUMA node and CPUs
//! each is close to — and the choice of GPUs for a multi-GPU request that keeps one
//! domain and one NUMA node together where it can (pure).
//!
//! Where it comes from: NVML (NVLink state and the remote end of each active link: another
//! GPU, or an NVSwitch, which joins every GPU wired to a switch into one domain; the NUMA
//! node and local CPU list of the GPU's PCI device from sysfs), or a simulated node's
//! file (`nvlink`, `numa_node`, `cpus` per GPU).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::inventory::Gpu;

/// One GPU's place in the node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuTopology {
    pub uuid: String,
    /// The NVLink domain: GPUs with the same number are joined by NVLink (directly or
    /// through NVSwitches). `None`: no active NVLink.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<u32>,
    /// The NUMA node of the GPU's PCI device; `None` where the machine has one node or
    /// does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// The CPUs local to the GPU, as a Linux CPU list (`0-15,32-47`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
}

/// The node's GPU topology; empty when the backend cannot tell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    pub gpus: Vec<GpuTopology>,
}

impl Topology {
    pub fn is_empty(&self) -> bool {
        self.gpus.iter().all(|g| g.nvlink_domain.is_none() && g.numa_node.is_none())
    }

    pub fn of(&self, uuid: &str) -> Option<&GpuTopology> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    pub fn domain(&self, uuid: &str) -> Option<u32> {
        self.of(uuid).and_then(|g| g.nvlink_domain)
    }

    pub fn numa(&self, uuid: &str) -> Option<u32> {
        self.of(uuid).and_then(|g| g.numa_node)
    }

    /// The GPUs of NVLink domain `domain`.
    pub fn domain_members(&self, domain: u32) -> impl Iterator<Item = &str> {
        self.gpus.iter().filter(move |g| g.nvlink_domain == Some(domain)).map(|g| g.uuid.as_str())
    }
}

/// NVLink domains from links between GPUs `0..n` (`(a, b)`: an active NVLink between GPU a
/// and GPU b; `switch`: GPUs with a link to an NVSwitch, all joined): the connected
/// components with at least one link, numbered from 0 in order of their lowest GPU.
pub fn domains_from_links(
    n: usize,
    links: &[(usize, usize)],
    switch: &[usize],
) -> Vec<Option<u32>> {
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(p: &mut [usize], x: usize) -> usize {
        let mut r = x;
        while p[r] != r {
            r = p[r];
        }
        let mut c = x;
        while p[c] != r {
            let next = p[c];
            p[c] = r;
            c = next;
        }
        r
    }
    let mut linked = vec![false; n];
    let join = |p: &mut Vec<usize>, a: usize, b: usize| {
        let (ra, rb) = (find(p, a), find(p, b));
        if ra != rb {
            p[ra.max(rb)] = ra.min(rb);
        }
    };
    for &(a, b) in links.iter().filter(|(a, b)| *a < n && *b < n && a != b) {
        linked[a] = true;
        linked[b] = true;
        join(&mut parent, a, b);
    }
    let switched: Vec<usize> = switch.iter().copied().filter(|&g| g < n).collect();
    for w in switched.windows(2) {
        join(&mut parent, w[0], w[1]);
    }
    for &g in &switched {
        linked[g] = true;
    }
    let mut numbers: BTreeMap<usize, u32> = BTreeMap::new();
    (0..n)
        .map(|g| {
            if !linked[g] {
                return None;
            }
            let root = find(&mut parent, g);
            let next = u32::try_from(numbers.len()).unwrap_or(u32::MAX);
            Some(*numbers.entry(root).or_insert(next))
        })
        .collect()
}

pub use tessera_api::cpulist::{parse_cpulist, render_cpulist, CpuListError, MAX_CPU};

/// (NVLink domain, NUMA node): how [`pick`] groups free GPUs.
type GroupKey = (Option<u32>, Option<u32>);

/// How a set of GPUs sits in the node, as a grant says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The one NVLink domain all of them are in.
    pub nvlink_domain: Option<u32>,
    /// The one NUMA node all of them are on.
    pub numa_node: Option<u32>,
    /// Words for the grant and its event: `NVLink domain 1, NUMA node 0`, or why not.
    pub note: String,
}

/// `count` of the `free` GPUs (whole GPUs nobody holds, in index order), chosen to keep
/// them in one NVLink domain and one NUMA node where the node allows it; among the groups
/// that fit, the smallest (so larger groups stay whole for larger requests), then the
/// lowest GPU index. Without topology: the lowest indices, and no placement.
pub fn pick<'a>(
    free: &[&'a Gpu],
    topo: &Topology,
    count: usize,
) -> (Vec<&'a Gpu>, Option<Placement>) {
    let lowest = || free.iter().take(count).copied().collect::<Vec<_>>();
    if topo.is_empty() || count == 0 || free.len() < count {
        return (lowest(), None);
    }
    let domain = |g: &Gpu| topo.domain(&g.uuid);
    let numa = |g: &Gpu| topo.numa(&g.uuid);
    // Groups of free GPUs by a key; the best that fits: fewest members, then lowest index.
    let best = |key: &dyn Fn(&Gpu) -> Option<GroupKey>| {
        let mut groups: BTreeMap<GroupKey, Vec<&'a Gpu>> = BTreeMap::new();
        for g in free {
            if let Some(k) = key(g) {
                groups.entry(k).or_default().push(g);
            }
        }
        groups
            .into_iter()
            .filter(|(_, gs)| gs.len() >= count)
            .min_by_key(|(_, gs)| (gs.len(), gs[0].index))
            .map(|(k, gs)| (k, gs.into_iter().take(count).collect::<Vec<_>>()))
    };
    let both = |g: &Gpu| match (domain(g), numa(g)) {
        (Some(d), Some(n)) => Some((Some(d), Some(n))),
        _ => None,
    };
    if let Some(((d, n), gs)) = best(&both) {
        let note = format!("NVLink domain {}, NUMA node {}", d.unwrap_or(0), n.unwrap_or(0));
        return (gs, Some(Placement { nvlink_domain: d, numa_node: n, note }));
    }
    if let Some(((d, _), gs)) = best(&|g: &Gpu| domain(g).map(|d| (Some(d), None))) {
        let nodes: std::collections::BTreeSet<String> =
            gs.iter().map(|g| numa(g).map_or("?".into(), |n| n.to_string())).collect();
        let note = format!(
            "NVLink domain {} (NUMA nodes {}: no NUMA node has {count} free GPUs of it)",
            d.unwrap_or(0),
            nodes.into_iter().collect::<Vec<_>>().join(", ")
        );
        let numa_node = if gs.iter().all(|g| numa(g) == numa(gs[0])) { numa(gs[0]) } else { None };
        return (gs, Some(Placement { nvlink_domain: d, numa_node, note }));
    }
    if let Some(((_, n), gs)) = best(&|g: &Gpu| numa(g).map(|n| (None, Some(n)))) {
        let note = format!("NUMA node {} (no NVLink domain has {count} free GPUs)", n.unwrap_or(0));
        return (gs, Some(Placement { nvlink_domain: None, numa_node: n, note }));
    }
    let gs = lowest();
    let note = format!("spans NVLink domains and NUMA nodes: no {count} free GPUs share either");
    (gs, Some(Placement { nvlink_domain: None, numa_node: None, note }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32) -> Gpu {
        Gpu {
            index,
            uuid: format!("GPU-{index}"),
            model: "H100-80GB".into(),
            minor: index,
            memory_mib: 81920,
            mig_enabled: false,
            instances: Vec::new(),
        }
    }

    /// Eight GPUs: NVLink pairs (0,1) (2,3) on NUMA 0, (4,5) (6,7) on NUMA 1.
    fn pairs() -> (Vec<Gpu>, Topology) {
        let gpus: Vec<Gpu> = (0..8).map(gpu).collect();
        let links = [(0, 1), (2, 3), (4, 5), (6, 7)];
        let domains = domains_from_links(8, &links, &[]);
        let topo = Topology {
            gpus: gpus
                .iter()
                .zip(domains)
                .map(|(g, d)| GpuTopology {
                    uuid: g.uuid.clone(),
                    nvlink_domain: d,
                    numa_node: Some(g.index / 4),
                    cpus: Some(if g.index < 4 { "0-15".into() } else { "16-31".into() }),
                })
                .collect(),
        };
        (gpus, topo)
    }

    fn indices(gs: &[&Gpu]) -> Vec<u32> {
        gs.iter().map(|g| g.index).collect()
    }

    #[test]
    fn domains_are_the_linked_components() {
        assert_eq!(
            domains_from_links(6, &[(0, 1), (3, 2), (1, 0)], &[]),
            [Some(0), Some(0), Some(1), Some(1), None, None]
        );
        assert_eq!(domains_from_links(4, &[], &[1, 2, 3]), [None, Some(0), Some(0), Some(0)]);
        assert_eq!(
            domains_from_links(2, &[(0, 0), (0, 9)], &[]),
            [None, None],
            "no self or foreign links"
        );
    }

    #[test]
    fn two_gpus_land_on_an_nvlink_pair_of_one_numa_node() {
        let (gpus, topo) = pairs();
        // GPU 0 and GPU 2 are taken: the first whole pair left is (4,5)... no: (4,5) and
        // (6,7) are both whole; best fit takes the lowest.
        let free: Vec<&Gpu> = gpus.iter().filter(|g| ![0, 2].contains(&g.index)).collect();
        let (gs, p) = pick(&free, &topo, 2);
        assert_eq!(indices(&gs), [4, 5]);
        let p = p.expect("placement");
        assert_eq!((p.nvlink_domain, p.numa_node), (Some(2), Some(1)));
        assert_eq!(p.note, "NVLink domain 2, NUMA node 1");
        // First-fit by index would have split a pair: 1 and 3.
        assert_eq!(indices(&free[..2]), [1, 3]);
    }

    #[test]
    fn one_gpu_goes_to_a_broken_pair_first() {
        let (gpus, topo) = pairs();
        let free: Vec<&Gpu> = gpus.iter().filter(|g| g.index != 4).collect();
        let (gs, _) = pick(&free, &topo, 1);
        assert_eq!(indices(&gs), [5], "the lone GPU of a broken pair keeps whole pairs whole");
    }

    #[test]
    fn without_a_fitting_domain_it_says_so() {
        let (gpus, topo) = pairs();
        let free: Vec<&Gpu> = gpus.iter().filter(|g| [0, 2, 4, 6].contains(&g.index)).collect();
        let (gs, p) = pick(&free, &topo, 2);
        assert_eq!(indices(&gs), [0, 2]);
        assert_eq!(p.expect("placement").note, "NUMA node 0 (no NVLink domain has 2 free GPUs)");
        let (gs, p) = pick(&free, &topo, 3);
        assert_eq!(indices(&gs), [0, 2, 4]);
        assert!(p.expect("placement").note.starts_with("spans"));
        let (gs, p) = pick(&free, &Topology::default(), 2);
        assert_eq!((indices(&gs), p), (vec![0, 2], None), "no topology: lowest, no note");
    }
}
