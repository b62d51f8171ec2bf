package netstat

import "testing"

func TestParse(t *testing.T) {
	const text = "Ip: Forwarding DefaultTTL\nIp: 1 64\nUdp: InDatagrams NoPorts InErrors InCsumErrors\nUdp: 10 2 3 7\nUdpLite: InDatagrams InCsumErrors\nUdpLite: 0 0\n"
	if v, err := parse(text, "Udp", "InCsumErrors"); err != nil || v != 7 {
		t.Errorf("Udp InCsumErrors: %d %v, want 7", v, err)
	}
	if v, err := parse(text, "UdpLite", "InCsumErrors"); err != nil || v != 0 {
		t.Errorf("UdpLite InCsumErrors: %d %v, want 0", v, err)
	}
	if _, err := parse(text, "Tcp", "InCsumErrors"); err == nil {
		t.Error("a missing group read without an error")
	}
	if v, err := SNMP("Udp", "InDatagrams"); err != nil || v < 0 {
		t.Errorf("this namespace's Udp InDatagrams: %d %v", v, err)
	}
}
