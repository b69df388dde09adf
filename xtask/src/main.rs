fn main() {
    eprintln!("xtask: no tasks yet");
}
