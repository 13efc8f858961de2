//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!`
//! embeds `migrations/` at compile time, and Cargo reruns a proc macro only
//! when a Rust source changes, so a new migration alone left tests running
//! the schema of the last build. The build script sqlx recommends.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
