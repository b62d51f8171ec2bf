// Package tunnel carries pod traffic between nodes: the kernel routes to
// the ranges that other peers own, and the encapsulation drivers that move
// packets between a TUN device and the underlay.
//
// # Data path
//
// The node's routing table sends every range owned by another peer to the
// TUN device "weft-tun" (routes with src = the bridge address). A Device
// reads those packets in batches, looks up the owner of each destination
// in the ring (SetRing) and the owner's underlay address (SetPeers), wraps
// the packet for the mode used with that owner and sends it. The receiver
// checks the frame and its sender, writes packets for its own ranges into
// its TUN device (the kernel delivers them to the bridge), and forwards a
// packet for a range that has moved on once more to the current owner,
// marked so that it is never forwarded twice. A packet is delivered or
// forwarded only if its inner source lies in a range the ring gives the
// peer that sent it (for a forwarded one: a range of a peer other than this
// node), as WireGuard's AllowedIPs. Anything malformed, from an address
// that is no peer, with a foreign source or without a route is dropped and
// counted by reason (weft_tunnel_dropped_packets_total), never forwarded;
// the reasons that point at an attack are warned about once a minute.
//
// # Modes
//
// udp: a 16-byte versioned header (frame.go) in front of the inner packet,
// over UDP to the owner's data port. ipip: IP protocol 4, through the
// kernel's IPIP device where the kernel has the ipip link type (routes
// "via <owner> dev weft-ipip onlink", as Calico does), else in userspace
// over the TUN device and a raw socket. vxlan (vxlan.go): the kernel's
// VXLAN device weft-vx carries the packets (learning off, no group); the
// Device only keeps a route via each peer's VTEP address onlink, a
// permanent neighbour and an FDB entry per peer (Peer.VTEP, LocalVTEP),
// which stay when the router stops, and keeps what it finds until Settle.
// auto: per peer, the first mode of this node's list (fastest first:
// kernel IPIP, vxlan, udp, userspace IPIP) that the peer advertises and
// that is allowed: the plaintext modes only where the traffic may be
// plaintext (no password, or the peer inside the trusted subnets; with a
// password, auto makes weft-vx only if this node is inside them too), and
// vxlan only towards a VTEP of the same port and VNI. The choice and its
// reason are logged, shown by Connections (Reason) and exported as
// weft_tunnel_peer_mode. Every vxlan path is probed once a second
// (probe.go: ARP probes through weft-vx, answered by the peer's kernel);
// auto sends udp to a peer whose path stopped answering and takes it back
// after a hold.
//
// # Encryption
//
// With Config.PSK (from the password, crypt.DeriveKeys), udp frames to
// and from every peer outside Config.TrustedSubnets are sealed with
// AES-256-GCM under per-peer, per-direction keys: X25519 between the key
// pair each node makes at start (its public key travels in the mesh
// metadata, Peer.PublicKey) mixed with the PSK, a new key every two
// minutes, the frame counter as the nonce, the header as associated data,
// and a replay window per key (tunnel/crypt, secure.go). Frames that do
// not authenticate, replays, and plaintext from a peer that must encrypt
// are dropped and counted (reasons auth, replay, plaintext, no-key); ipip,
// which cannot be encrypted, is used only inside trusted subnets. See
// docs/security.md.
//
// # Speed
//
// The TUN device is opened with TCP segmentation offload: the kernel hands
// over 64 KiB TCP super-packets, which the device cuts into pod-MTU
// packets, and runs of segments of one flow are joined again before they
// are written back (tun/offload.go). The UDP socket sends each run as one
// GSO send and receives GRO buffers; every system call moves a batch
// (recvmmsg, sendmmsg). Buffers are reused: nothing is allocated per packet
// but the source address that x/net's recvmmsg makes per datagram (per GRO
// buffer). See docs/benchmarks.md, "Data plane".
//
// # Seams
//
// The kernel sits behind two small interfaces, tun.Device and conn.Bind,
// with channel fakes in tun/tuntest and conn/bindtest, so that devices can
// exchange packets in tests without root (as wireguard-go does).
//
// # Wiring (the router)
//
//	dev, err := tunnel.New(tunnel.Config{
//		Self: name, Mode: encap, MTU: podMTU, UnderlayMTU: underlayMTU,
//		Underlay: host, Listen: netip.AddrPortFrom(netip.IPv4Unspecified(), dataPort),
//		PSK: keys.PSK[:], TrustedSubnets: trusted, // with a password; nil PSK without
//		Logger: log, Registerer: reg,
//	})
//	// advertise dev.Encaps() and dev.PublicKey() in the mesh metadata, then:
//	go dev.Run(ctx)
//	dev.SetPeers(peers)           // on every change of the mesh's peers, Peer.PublicKey from their metadata
//	dev.SetRing(ranges, bridgeIP) // on every change of the ring, once the bridge has its address
//	dev.Connections()             // for `weft status connections`
//	dev.Encryption()              // "Encryption: enabled" in `weft status`
package tunnel
