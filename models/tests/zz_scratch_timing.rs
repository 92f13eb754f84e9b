use models::llama::{Llama, LlamaConfig};
use nn::Module;
use std::time::Instant;
#[test]
fn timing() {
    let t = Instant::now();
    let mut rng = tensor::Rng::new(1);
    let x = tensor::Tensor::rand_normal(&[58_000_000], 0.0, 0.02, &mut rng);
    println!("58M normals {:.2?} {}", t.elapsed(), x.numel());
    let t = Instant::now();
    let x = tensor::Tensor::kaiming_uniform(&[58_000_000], 512, &mut rng);
    println!("58M uniform {:.2?} {}", t.elapsed(), x.numel());
    let t = Instant::now();
    let m = Llama::new(&LlamaConfig::preset("llama-60m").unwrap(), 0).unwrap();
    println!("build {:.2?} {}", t.elapsed(), m.num_parameters());
    let t = Instant::now();
    drop(m);
    println!("drop {:.2?}", t.elapsed());
}
