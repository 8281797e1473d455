// Fingerprints the plugin boundary: a hash of the sources that define what
// crosses it (the C structures and the JSON wire types). A plugin built
// against any other version of them is refused at load.
const BOUNDARY_SOURCES: &[&str] = &[
    "src/plugin/abi.rs",
    "src/request.rs",
    "src/event.rs",
    "src/engine.rs",
];

fn main() {
    // FNV-1a: stable across platforms and compilers; not a security hash.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for path in BOUNDARY_SOURCES {
        println!("cargo:rerun-if-changed={path}");
        let text = std::fs::read_to_string(path).expect("read a boundary source");
        // Line endings do not change the boundary.
        for byte in text.replace("\r\n", "\n").bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=ENGINE_CORE_BOUNDARY_HASH={hash:016x}");
}
