//! Builds the NIC's fault-guarded memory accesses (`src/fault_guard.c`): C, because
//! recovering from a fault inside a copy needs `sigsetjmp`, which Rust cannot call.

fn main() {
    println!("cargo:rerun-if-changed=src/fault_guard.c");
    cc::Build::new()
        .file("src/fault_guard.c")
        .flag_if_supported("-Wall")
        .opt_level(2)
        .compile("rnic_fault_guard");
}
