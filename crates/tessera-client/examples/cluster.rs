//! Writes and reads keys through a Tessera (or Redis) cluster from many
//! tasks at once, then reads one at a chosen consistency level.
//!
//! ```sh
//! tessera cluster up                      # a local cluster on 127.0.0.1:7001-7006
//! cargo run --release -p tessera-client --example cluster -- 127.0.0.1:7001
//! ```

use std::time::Instant;

use tessera_client::{cmd, ClusterClient, Level, Options};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seed = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:7001".into());
    let client = ClusterClient::connect(&[seed.as_str()], Options::default()).await?;

    // 64 tasks, each with its requests in flight on shared, pipelined connections.
    let started = Instant::now();
    let tasks: Vec<_> = (0..64)
        .map(|task| {
            let client = client.clone();
            tokio::spawn(async move {
                for n in 0..250 {
                    client.set(format!("example:{task}:{n}"), format!("value {n}")).await?;
                }
                Ok::<_, tessera_client::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let elapsed = started.elapsed();
    println!("16000 SETs in {elapsed:?} ({:.0} per second)", 16000.0 / elapsed.as_secs_f64());

    // A batch: commands for one node go out in one write.
    let reads: Vec<_> = (0..250).map(|n| cmd("GET").key(format!("example:0:{n}")).idempotent()).collect();
    let answers = client.pipeline(&reads).await;
    println!("{} GETs answered in one pipeline", answers.iter().filter(|answer| answer.is_ok()).count());

    // One read at the eventual level: any replica may serve it.
    let (level, value) = client.read_at(Level::Eventual, cmd("GET").key("example:0:0")).await?;
    println!("example:0:0 = {value:?}, served {}", level.name());
    Ok(())
}
