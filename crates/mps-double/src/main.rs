//! `fake-nvidia-cuda-mps-control`: a TEST DOUBLE of NVIDIA's `nvidia-cuda-mps-control` that
//! speaks the documented MPS control protocol without a GPU. See the `mps_double` library
//! for what it does and its test-only hooks. Production uses the real binary.

fn main() {
    std::process::exit(mps_double::main());
}
