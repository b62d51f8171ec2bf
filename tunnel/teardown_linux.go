package tunnel

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
)

// RemoveKernelIPIP deletes the kernel IPIP device name from the calling
// thread's network namespace, if there is one (weft reset: the device is
// otherwise kept across restarts so that traffic keeps flowing). Routes
// through it go with it.
func RemoveKernelIPIP(name string) error { return removeLink[*netlink.Iptun](name) }

// removeLink deletes the link name from the calling thread's network
// namespace if it is a T (the kind of device weft makes by that name): a
// missing link is no error, and a link of another kind is not weft's and
// stays.
func removeLink[T netlink.Link](name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		if errors.As(err, new(netlink.LinkNotFoundError)) {
			return nil
		}
		return fmt.Errorf("looking up %s: %w", name, err)
	}
	if _, ok := l.(T); !ok {
		return nil // not ours
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("removing %s: %w", name, err)
	}
	return nil
}
