// Package tuntest is a channel-backed fake of tun.Device, so that tunnel
// devices can exchange packets in tests without root (after wireguard-go's
// tun/tuntest).
package tuntest

import (
	"fmt"
	"sync"

	"github.com/weft-net/weft/tunnel/tun"
)

// Device is a fake TUN device with one queue. Send packets to Inbound as
// if the kernel routed them into the device; read what the tunnel wrote
// (delivered to the kernel) from Outbound.
type Device struct {
	Inbound  chan []byte
	Outbound chan []byte

	name   string
	mtu    int
	closed chan struct{}
	once   sync.Once
}

// New returns a fake device with buffered channels.
func New(name string, mtu int) *Device {
	return &Device{
		Inbound:  make(chan []byte, 1024),
		Outbound: make(chan []byte, 1024),
		name:     name,
		mtu:      mtu,
		closed:   make(chan struct{}),
	}
}

// Name implements tun.Device.
func (d *Device) Name() string { return d.name }

// MTU implements tun.Device.
func (d *Device) MTU() int { return d.mtu }

// BatchSize implements tun.Device.
func (d *Device) BatchSize() int { return 16 }

// Queues implements tun.Device: the device is its own single queue.
func (d *Device) Queues() []tun.Queue { return []tun.Queue{d} }

// Close implements tun.Device; it unblocks pending reads and writes.
func (d *Device) Close() error {
	d.once.Do(func() { close(d.closed) })
	return nil
}

// Read implements tun.Queue: it waits for one packet on Inbound, then
// takes whatever else is already queued, up to the batch.
func (d *Device) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	n := 0
	for n < len(bufs) {
		var p []byte
		if n == 0 {
			select {
			case p = <-d.Inbound:
			case <-d.closed:
				return 0, tun.ErrClosed
			}
		} else {
			select {
			case p = <-d.Inbound:
			default:
				return n, nil
			}
		}
		if len(p) > len(bufs[n])-offset {
			return n, fmt.Errorf("tuntest: packet of %d bytes does not fit a buffer of %d", len(p), len(bufs[n])-offset)
		}
		sizes[n] = copy(bufs[n][offset:], p)
		n++
	}
	return n, nil
}

// Write implements tun.Queue: it copies each packet to Outbound.
func (d *Device) Write(bufs [][]byte, offset int) (int, error) {
	for i, b := range bufs {
		p := append([]byte(nil), b[offset:]...)
		select {
		case d.Outbound <- p:
		case <-d.closed:
			return i, tun.ErrClosed
		}
	}
	return len(bufs), nil
}
