//! A broken config file stops the program before it contacts Redis: nothing is created.

use std::time::Duration;

use stream_listener::testing::RedisServer;
use stream_listener::{Config, ConfigError, RunError, run_listeners};
use stream_listener::{Delivery, ListenerRegistration, core::handler::HandlerFuture};

fn ignore(_: Delivery) -> HandlerFuture {
    Box::pin(async { Ok(()) })
}

#[tokio::test]
async fn broken_files_name_key_and_line_and_create_nothing() {
    let server = RedisServer::start().unwrap();
    let dir = std::env::temp_dir().join(format!("sl-config-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "shard_cuont = 8",
            "streams.orders.shard_cuont",
            "unknown field `shard_cuont`",
        ),
        (
            "shards = \"eight\"",
            "streams.orders.shards",
            "invalid type: string \"eight\"",
        ),
        (
            "shards = \"eight",
            "streams.orders.shards",
            "invalid basic string",
        ),
    ];
    for (line, key, message) in cases {
        let path = dir.join("stream-listener.toml");
        let text = format!(
            "[redis]\nurl = \"{}\"\n\n[streams.orders]\n{line}\n",
            server.url()
        );
        std::fs::write(&path, text).unwrap();
        let err = Config::from_file(&path).unwrap_err();
        let ConfigError::Invalid {
            key: found,
            location: Some(location),
            ..
        } = &err
        else {
            panic!("expected Invalid with a location, got {err:?}");
        };
        assert_eq!(found, key);
        assert_eq!(location.line, 5);
        assert_eq!(location.file, path.display().to_string());
        let text = err.to_string();
        assert!(text.contains(message), "{text}");
        assert!(text.contains(&format!("{}:5:", path.display())), "{text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();

    // A config built in code is validated by run_listeners before it connects.
    let mut config = Config::default();
    config.redis.url = Some(server.url());
    config.coordination.heartbeat_interval = Duration::from_secs(10);
    let listeners = vec![ListenerRegistration::new("l", "orders", "g", ignore)];
    let err = run_listeners(config, listeners).await.unwrap_err();
    assert!(
        matches!(&err, RunError::Config(e) if e.key() == Some("coordination.heartbeat_interval")),
        "{err:?}"
    );

    let mut conn = server.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert!(keys.is_empty(), "nothing created: {keys:?}");
}
