//go:build !linux

package tunnel

// RemoveKernelIPIP does nothing where there is no kernel IPIP.
func RemoveKernelIPIP(name string) error { return nil }

// RemoveKernelVXLAN does nothing where there is no kernel VXLAN.
func RemoveKernelVXLAN(name string) error { return nil }
