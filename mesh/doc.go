// Package mesh is a peer's membership in the weft mesh: peers find each
// other and gossip over hashicorp/memberlist (SWIM: random probes with
// indirect probes and suspicion for failure detection, epidemic
// piggy-backed broadcasts, periodic full-state push-pull).
//
// # Wiring
//
//	m, err := mesh.New(mesh.Config{
//		Name: name, Nickname: nick,             // state.DB.PeerName, --nickname
//		BindAddr: host, Port: 6783,             // --host, --port
//		Version: version,
//		SecretKey: keys.Gossip[:],              // with a password (crypt.DeriveKeys)
//		Components: []mesh.Component{tunnel},   // opaque blobs of other packages
//		Peers: peers, Remembered: remembered,   // --peers, saved KnownPeers
//		Logger: log, Registerer: reg,
//	})
//	ch, err := m.Channel("ipalloc", gossiper)   // every channel before Start
//	err = m.Start(ctx)
//	defer m.Close()                             // leaves gracefully
//	... m.KnownPeers() to persist; m.WriteStatus, WriteStatusPeers,
//	WriteStatusConnections and Report for /status; m.Subscribe for events.
//
// # Metadata
//
// Each peer publishes a small record in memberlist's node metadata (at
// most 512 bytes, sent with every alive message): its nickname, version
// and one blob per registered Component ("tunnel": the data port,
// encapsulations and public key, encoded by the router). The mesh knows a
// blob's name, version and bound, never its fields. A peer's blob is
// checked by its component's Check: one that fails is refused for that
// component alone (Meta.Refused, logged, weft_mesh_invalid_metadata_total);
// blobs of components this peer does not know are kept and ignored. The
// encoding (meta.go) is version 2, which keeps main's version-1 layout up
// to the version string, the tunnel's record in its old place, so that
// routers of either version read each other during a rolling upgrade.
//
// # Gossip channels
//
// A Channel carries one package's data, named in every message. Broadcast
// queues a delta (at most MaxBroadcastSize) in memberlist's
// TransmitLimitedQueue, which piggybacks it on gossip packets to
// GossipNodes random peers per GossipInterval, each queued message being
// sent RetransmitMult*ceil(log10(N+1)) times. That alone reaches only a
// few dozen peers, so a receiver re-broadcasts what was new to it
// (Gossiper.OnBroadcast returns it): the spread is epidemic, and ends when
// nobody learns anything. SendTo is a reliable unicast over a stream.
// LocalState/MergeRemoteState exchange every channel's complete state,
// framed in one blob, on each push-pull and on join; that is the
// anti-entropy that repairs lost broadcasts and merges healed partitions.
// Mesh.PushPull makes that exchange now with one chosen peer, for a
// component that knows whose state it lacks.
// Every frame from a peer is validated; a bad one is dropped and counted
// by reason (weft_mesh_dropped_messages_total), logged at debug and at
// most once a minute per reason at info, never a panic.
//
// # Topology
//
// Peers shows every known peer: alive, suspect, unreachable (memberlist
// declared it dead) or left (it closed gracefully), with its address,
// metadata and last change. Each peer publishes, on an internal channel,
// which peers it sees unreachable (usually none, so the report stays tiny
// at any size); from these reports the view says from how many live peers
// a peer is reachable, and calls a peer suspect when memberlist here still
// counts it alive but another live peer reports it unreachable
// (memberlist's own short SWIM suspicion is not in its API). A goodbye
// report sent before memberlist's leave tells "left" from "unreachable".
//
// # Timings
//
// DefaultTimings are memberlist's DefaultLANConfig, which Consul and Serf
// run on LANs of thousands of nodes, with more retransmissions and a
// shorter TCP timeout. For up to about 1000 peers:
//
//   - GossipInterval 200 ms, GossipNodes 3: each round a peer with news
//     sends it to 3 random peers. With relaying, the informed set grows
//     about fourfold per round, so news reaches N peers in about
//     log4(N) + a few rounds: ~1 s for 100 peers, ~1.5-2 s for 1000
//     (Serf's simulator: 99.99% of 100 nodes in about 2 s at these
//     settings). A faster interval buys little and costs packets.
//   - RetransmitMult 6 (memberlist: 4): every peer that learns a message
//     sends it L = 6*ceil(log10(N+1)) times to random peers, so a peer
//     receives about L copies and misses them all with probability about
//     exp(-L*(1-loss)). With 4, L is 8 for 10 to 99 peers: with 10% loss
//     a peer misses a message with probability 7.5e-4, so 1-4% of
//     messages leave some peer waiting for the next push-pull (30-60 s),
//     which the benchmark showed. With 6, L is 12 there (per-peer miss
//     2e-5) and 24 at 1000 peers; broadcasts are rare in steady state, so
//     the extra bytes are small.
//   - ProbeInterval 1 s, ProbeTimeout 500 ms, SuspicionMult 4: a failed
//     peer is probed by someone within about a second, then suspected for
//     4*max(1, log10 N) s (4 s at 10 peers, 8 s at 100, 12 s at 1000;
//     longer, up to 6x, while nobody else confirms it), so the others see
//     it unreachable about 5-15 s after it fails. A shorter probe timeout
//     would raise false suspicions under load.
//   - PushPullInterval 30 s (memberlist stretches it above 32 peers: 90 s
//     at 100, 180 s at 1000), so a full exchange of ~100 bytes per peer
//     (plus channel state) costs each peer well under 1 KB/s even at 1000.
//   - GossipToTheDeadTime 30 s: dead peers still get gossip for 30 s, so
//     one cut off briefly learns it was declared dead and refutes it; then
//     memberlist forgets them, and the join loop (ReconnectInterval 10 s)
//     keeps knocking on their addresses and the --peers targets, which is
//     how two sides of a healed partition find each other again.
//   - DeadNodeReclaimTime 30 s: a peer restarted with a new address under
//     its persisted name is accepted after 30 s instead of refused as a
//     name conflict.
//   - TCPTimeout 5 s (memberlist: 10 s): bounds a join attempt on a
//     black-holed address, and so Close; a 1000-peer push-pull is ~100 KB.
//
// # Authentication
//
// With Config.SecretKey (the gossip key derived from the password),
// memberlist encrypts and authenticates every packet and stream
// (AES-256-GCM, its keyring) and refuses the rest, so a peer with no or
// another password cannot join. A guard between the socket and memberlist
// (guard.go, transport.go) checks every incoming packet and stream against
// the key before memberlist sees it, within PreAuthLimits: a stream may
// carry at most MaxStreamSize, all unauthenticated streams together hold
// at most Budget bytes and MaxStreams slots (MaxStreamsPerSource from one
// address), each for at most Timeout. Refusals are counted by reason
// (weft_mesh_preauth_refused_total) and logged at most once a minute per
// reason; authentication failures become one warning per remote host a
// minute, at most 8 hosts a minute ("peer 10.0.0.9:6783 failed
// authentication: wrong or missing password ..."), counted in
// weft_mesh_auth_failures_total (logadapter.go). memberlist's own lines
// are sanitised and rate-limited by kind. A topology report is kept only
// from a peer memberlist announced. See docs/security.md.
//
// See docs/mesh.md for the operator's view and docs/benchmarks.md for the
// measurements (go run ./mesh/cmd/meshbench).
package mesh
