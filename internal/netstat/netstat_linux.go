// Package netstat reads the kernel's protocol counters (/proc/net/snmp)
// of the calling thread's network namespace, for the tests that show a
// fault reached a kernel (a datagram dropped for its checksum).
package netstat

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// SNMP is the counter field of group (e.g. "Udp", "InCsumErrors") in
// the calling thread's network namespace: run it inside the namespace's
// Do (it reads /proc/thread-self, not the process's namespace).
func SNMP(group, field string) (int64, error) {
	data, err := os.ReadFile("/proc/thread-self/net/snmp")
	if err != nil {
		return 0, err
	}
	return parse(string(data), group, field)
}

// parse reads field of group from /proc/net/snmp's text: each group is a
// line of names and a line of values, both starting "Group:".
func parse(text, group, field string) (int64, error) {
	lines := strings.Split(text, "\n")
	for i := 0; i+1 < len(lines); i++ {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) < 2 || names[0] != group+":" || len(values) != len(names) || values[0] != group+":" {
			continue
		}
		for j, name := range names {
			if name == field {
				return strconv.ParseInt(values[j], 10, 64)
			}
		}
	}
	return 0, fmt.Errorf("netstat: no %s %s in /proc/net/snmp", group, field)
}
