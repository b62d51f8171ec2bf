// Package tun is weft's seam at the TUN device: an interface that moves
// batches of IP packets between the kernel and the tunnel, with the
// songgao/water implementation in tun_linux.go and channel fakes in
// tun/tuntest, after wireguard-go's tun.Device.
package tun

import (
	"errors"
	"fmt"
)

// Queue is one queue of a TUN device. Reads and writes move whole IP
// packets (no packet-information prefix). A queue may be read by one
// goroutine and written by another at the same time; two readers or two
// writers of the same queue need their own synchronisation.
type Queue interface {
	// Read reads up to len(bufs) packets. Packet i lands in
	// bufs[i][offset:] and is sizes[i] bytes long; the bytes before
	// offset are left alone, so that the caller can build a header in
	// place. It blocks until at least one packet is there and returns
	// how many it read.
	Read(bufs [][]byte, sizes []int, offset int) (n int, err error)
	// Write hands the packets bufs[i][offset:] to the kernel and returns
	// how many it wrote. The bytes before offset are scratch space that
	// an implementation may overwrite: an offloading device writes its
	// VirtioNetHdrLen-byte header there, so offset must be at least that.
	// A packet that the kernel rejects is skipped and reported in the
	// error after the others are written (see WriteError).
	Write(bufs [][]byte, offset int) (n int, err error)
}

// Device is a TUN interface with one or more queues.
type Device interface {
	// Name is the interface name, e.g. "weft-tun".
	Name() string
	// MTU is the interface MTU.
	MTU() int
	// BatchSize is the most packets one Read returns or one Write takes
	// at a time that the implementation handles efficiently.
	BatchSize() int
	// Queues are the device's queues: several with IFF_MULTI_QUEUE,
	// each served by its own goroutines.
	Queues() []Queue
	// Close closes every queue, which unblocks pending reads with
	// ErrClosed, and removes the interface if nothing else holds it.
	Close() error
}

// ErrClosed is returned by reads and writes on a closed device.
var ErrClosed = errors.New("tun device closed")

// WriteError reports packets that the kernel refused in a Write; the
// other packets of the batch were written.
type WriteError struct {
	Failed int   // packets refused
	Err    error // the first reason
}

func (e *WriteError) Error() string {
	return fmt.Sprintf("tun write: %d packet(s) refused: %v", e.Failed, e.Err)
}

func (e *WriteError) Unwrap() error { return e.Err }
