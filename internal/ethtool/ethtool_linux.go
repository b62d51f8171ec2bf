// Package ethtool turns a network device's transmit checksum offload on
// or off (what `ethtool -K DEV tx on|off` does), for the tests that model
// a device that computes checksums wrongly: with the offload off, the
// kernel computes every checksum in software before a frame leaves, so
// that the receiving kernel checks it, even across veth pairs (which
// otherwise pass the checksum along unfinished).
package ethtool

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// From include/uapi/linux/ethtool.h.
const (
	cmdGetTxCsum = 0x16 // ETHTOOL_GTXCSUM
	cmdSetTxCsum = 0x17 // ETHTOOL_STXCSUM
)

type value struct {
	cmd  uint32
	data uint32
}

type ifreq struct {
	name [unix.IFNAMSIZ]byte
	data unsafe.Pointer
	_    [16]byte // the rest of the union
}

func call(dev string, v *value) error {
	if len(dev) >= unix.IFNAMSIZ {
		return fmt.Errorf("ethtool: device name %q too long", dev)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("ethtool: %w", err)
	}
	defer unix.Close(fd)
	var r ifreq
	copy(r.name[:], dev)
	r.data = unsafe.Pointer(v)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&r))); errno != 0 {
		return fmt.Errorf("ethtool on %s (command %#x): %w", dev, v.cmd, errno)
	}
	return nil
}

// SetTxChecksum turns dev's transmit checksum offload on or off, in the
// calling thread's network namespace.
func SetTxChecksum(dev string, on bool) error {
	v := value{cmd: cmdSetTxCsum}
	if on {
		v.data = 1
	}
	return call(dev, &v)
}

// TxChecksum reports whether dev's transmit checksum offload is on.
func TxChecksum(dev string) (bool, error) {
	v := value{cmd: cmdGetTxCsum}
	err := call(dev, &v)
	return v.data != 0, err
}
